"""Link delay for namespace hosts on kernels without netem (tests and bench): a netfilter
rule sends a host's egress to an NFQUEUE, and link_delay.c, run in the host's namespace,
accepts each packet a fixed number of microseconds after it arrived. The trip through user
space costs about 40 us a packet more on this project's VMs (measured with a delay of 1 us).
Needs gcc, libnetfilter-queue-dev and iptables (`apt-get install gcc libnetfilter-queue-dev
iptables`); the serving path never uses it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("link_delay.c")
HEADER = Path("/usr/include/libnetfilter_queue/libnetfilter_queue.h")


def link_delay_unavailable() -> str | None:
    """None where delays can be added (compiler, library headers, iptables), else what is
    missing."""
    if shutil.which("gcc") is None:
        return "gcc is not installed (the delay program is compiled on first use)"
    if not HEADER.exists():
        return "libnetfilter_queue's headers are missing (apt-get install libnetfilter-queue-dev)"
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    return None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spmd_runtime" / "link_delay"


def link_delay_binary(directory: Path | None = None) -> Path:
    """The compiled delay program, rebuilt when the source is newer than the build."""
    directory = directory or cache_dir()
    binary = directory / "link_delay"
    if binary.exists() and binary.stat().st_mtime >= SOURCE.stat().st_mtime:
        return binary
    directory.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed onto it: a concurrent build never runs a half file.
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".link_delay.")
    os.close(fd)
    try:
        subprocess.run(["gcc", "-O2", "-o", partial, str(SOURCE), "-lnetfilter_queue",
                        "-lnfnetlink"], check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, binary)
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"cannot compile {SOURCE}: {error.stderr.strip()}") from None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return binary


def egress_queue_rule(interface: str, queue: int) -> list[str]:
    """iptables' spec of a rule, in chain OUTPUT, sending everything the host sends on
    `interface` to `queue`; with --queue-bypass packets pass undelayed whenever no program is
    bound to the queue. (iptables, not nft: nft's own queue statement needs CONFIG_NFT_QUEUE,
    which this project's kernels lack; iptables-nft reaches the same queue through xt_NFQUEUE.)"""
    return ["-o", interface, "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]


def wait_bound(program: subprocess.Popen) -> None:
    """Block until the delay program says it is bound to its queue (or fail with its error)."""
    if program.stdout.readline().strip() != "ready":
        program.wait(10)
        raise RuntimeError(f"link_delay did not start: {program.stderr.read().strip()}")


ECHO_PORT = 29123
# Host 1 serves: it echoes small messages, or swallows a bulk transfer and answers its size.
SERVER = """
import socket, sys
listener = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    kind = conn.recv(1)
    if kind == b"e":
        while (data := conn.recv(64)):
            conn.sendall(data)
    else:
        total = 0
        while (data := conn.recv(1 << 20)):
            total += len(data)
        conn.sendall(str(total).encode())
    conn.close()
"""
# Host 0 measures: the median of `rounds` 32-byte round trips, then one bulk transfer.
CLIENT = """
import json, socket, statistics, sys, time
address, rounds, bulk = (sys.argv[1], int(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
with socket.create_connection(address) as conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(b"e")
    trips = []
    for _ in range(rounds + 5):                     # the first few warm up
        started = time.perf_counter()
        conn.sendall(b"x" * 32)
        got = 0
        while got < 32:
            got += len(conn.recv(64))
        trips.append(time.perf_counter() - started)
rate = None
if bulk:
    with socket.create_connection(address) as conn:
        chunk = b"\\0" * (1 << 20)
        started = time.perf_counter()
        conn.sendall(b"b")
        for _ in range(bulk):
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        assert int(conn.recv(64)) == bulk << 20
        rate = bulk * (1 << 20) / 1e6 / (time.perf_counter() - started)
print(json.dumps({"rtt_ms": statistics.median(trips[5:]) * 1e3, "bulk_mb_s": rate}))
"""


def measure_link(hosts, rounds: int = 50, bulk_mib: int = 0) -> dict:
    """Between hosts 0 and 1 of a NamespaceHosts: the median round trip of `rounds` 32-byte
    messages ("rtt_ms") and, with bulk_mib, the rate of one bulk transfer ("bulk_mb_s")."""
    server = hosts.popen(1, [sys.executable, "-c", SERVER, hosts.addresses[1], str(ECHO_PORT)],
                         stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError("the echo server on host 1 did not start")
        probe = hosts.run(0, [sys.executable, "-c", CLIENT, hosts.addresses[1], str(ECHO_PORT),
                              str(rounds), str(bulk_mib)], capture_output=True, text=True,
                          timeout=120)
        if probe.returncode:
            raise RuntimeError(f"the link probe failed: {probe.stderr[-2000:]}")
        return json.loads(probe.stdout)
    finally:
        server.kill()
        server.wait(10)
