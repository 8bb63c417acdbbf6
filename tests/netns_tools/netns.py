"""Hosts made of network namespaces, for tests and benchmarks of multi-node jobs on one
machine: each host is a namespace with its own eth0 and
address, all plugged into one bridge that lives in a "switch" namespace of its own, so nothing
on the machine's own network changes. Processes started on a host see only its interfaces
(and its loopback), as on a separate machine; the host name still resolves to 127.0.0.1, as it
does on many machines and containers.

    with NamespaceHosts(3) as hosts:
        hosts.popen(0, [sys.executable, "-m", "spmd_runtime.launch", ...])

`shape` limits a host's sending rate and can add a fixed delay to each packet it sends (see
link_delay.py beside this file). Every namespace, and every process inside one, is removed
on exit, also when the test fails;
`namespaces_unavailable()` says why a test must skip where namespaces cannot be made."""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

from netns_tools import link_delay

PACKET_CAPTURE = Path(__file__).with_name("packet_capture.py")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@functools.lru_cache(maxsize=1)
def namespaces_unavailable() -> str | None:
    """None where this process can make namespaces with a veth pair, else the reason."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (make env installs it)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"spmdprobe{uuid.uuid4().hex[:6]}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        veth = _ip("-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
                   check=False)
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", name, check=False)


class NamespaceHosts:
    def __init__(self, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = [f"spmd{tag}h{i}" for i in range(count)]
        self.switch = f"spmd{tag}sw"
        subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
        self.addresses = [f"{subnet}.{i + 1}" for i in range(count)]
        self.interface = "eth0"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._delays: dict[int, subprocess.Popen] = {}

    def __enter__(self) -> "NamespaceHosts":
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for index, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", name)
            self._made.append(name)
            port = f"port{index}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                self.interface, "netns", name)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", self.interface)
            _ip("-n", name, "link", "set", self.interface, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run on `host` (ip netns exec replaces itself: the pid is argv's own)."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kwargs)

    def set_link(self, host: int, up: bool) -> None:
        """Plug the host's cable in or out (its end of the veth pair, on the switch side)."""
        _ip("-n", self.switch, "link", "set", f"port{host}", "up" if up else "down")

    @contextlib.contextmanager
    def capture(self, host: int, out_path: str | os.PathLike):
        """Capture every frame on the host's interface while the block runs; yields a callable
        that returns the bytes captured (after the block: all of them)."""
        sniffer = self.popen(host, [sys.executable, str(PACKET_CAPTURE), self.interface,
                                    os.fspath(out_path)],
                             stdout=subprocess.PIPE, text=True)
        try:
            if sniffer.stdout.readline().strip() != "capturing":
                raise AssertionError(f"the capture on host {host} did not start")
            yield lambda: open(out_path, "rb").read()
        finally:
            sniffer.terminate()
            try:
                sniffer.wait(10)
            except subprocess.TimeoutExpired:
                sniffer.kill()

    def shape(self, host: int, rate: str, delay_us: int = 0) -> None:
        """Limit what the host sends to `rate` (tc's token bucket, e.g. "1gbit") and, with
        `delay_us`, hold each packet it sends that long first. Kernels built without modules,
        as this project's VMs, lack netem, so the delay is link_delay.c behind an iptables
        NFQUEUE rule (see link_delay.py beside this file for what it needs). A delay
        of D on every host makes a one-way latency of D between any two of them."""
        self.run(host, ["tc", "qdisc", "replace", "dev", self.interface, "root", "tbf", "rate",
                        rate, "burst", "512kb", "latency", "50ms"], check=True,
                 capture_output=True, timeout=30)
        self._set_delay(host, delay_us)

    def _set_delay(self, host: int, delay_us: int) -> None:
        queue = 0                       # queue numbers are per namespace: every host has its 0
        rule = ["OUTPUT", *link_delay.egress_queue_rule(self.interface, queue)]
        old = self._delays.pop(host, None)
        if old is not None:
            self.run(host, ["iptables", "-D", *rule], check=True, capture_output=True, timeout=30)
            old.terminate()
            old.wait(10)
        if delay_us <= 0:
            return
        program = self.popen(host, [str(link_delay.link_delay_binary()), str(queue),
                                    str(int(delay_us))], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        link_delay.wait_bound(program)
        self._delays[host] = program
        self.run(host, ["iptables", "-A", *rule], check=True, capture_output=True, timeout=30)

    def pids(self, host: int) -> list[int]:
        listed = _ip("netns", "pids", self.names[host], check=False).stdout.split()
        return [int(pid) for pid in listed]

    def close(self) -> None:
        """Kill everything running on the hosts, then remove every namespace made."""
        victims = []
        for name in self._made:
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    victims.append(psutil.Process(int(pid)))
                except psutil.NoSuchProcess:
                    pass
        for proc in self._procs:
            try:
                victims.append(psutil.Process(proc.pid))
                victims.extend(psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        for victim in victims:
            try:
                victim.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=10)
        for proc in self._procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        self._delays.clear()
