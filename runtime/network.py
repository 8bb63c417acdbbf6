"""Which network interface a worker's collectives use to reach the master.

Gloo and NCCL advertise the address the host name resolves to unless told an interface; on
many machines and containers that is 127.0.0.1, which other hosts cannot reach. The interface
whose address the kernel would send from towards the master is the one to use."""
from __future__ import annotations

import ipaddress
import os
import socket

import psutil

# torch.distributed's own variables naming the interface; one set by the user is kept.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def route_source_address(host: str, port: int) -> str:
    """The local address the kernel sends from to reach host:port (a UDP connect sends
    nothing). OSError when there is no route."""
    family = socket.AF_INET6 if ":" in host and not host.startswith("[") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), port or 9))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface holding this local address."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    return None


def choose_socket_interface(master_addr: str, master_port: int,
                            environ: dict | None = None) -> str:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface that reaches the master,
    where the user has named none and the master is not this host's loopback. Returns one
    line saying what was chosen and why, for the worker's log."""
    environ = os.environ if environ is None else environ
    named = {name: environ[name] for name in SOCKET_IFNAME_VARIABLES if environ.get(name)}
    if named:
        return "collectives use the interface named by " + ", ".join(
            f"{name}={value}" for name, value in named.items())
    if is_loopback(master_addr):
        return f"collectives use loopback (master {master_addr} is this host)"
    try:
        source = route_source_address(master_addr, master_port)
    except OSError as error:
        return f"no route to master {master_addr} found ({error}); collectives use the defaults"
    interface = interface_of(source)
    if interface is None:
        return (f"address {source} (the route to master {master_addr}) is on no interface "
                "found; collectives use the defaults")
    for name in SOCKET_IFNAME_VARIABLES:
        environ[name] = interface
    return (f"collectives use interface {interface} ({source}), the route to master "
            f"{master_addr}; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose another")
