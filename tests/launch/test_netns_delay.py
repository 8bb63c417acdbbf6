"""Delayed links between namespace hosts (launch/link_delay.py): a delay of D on each host's
egress adds 2*D to a round trip, and a shaped link still carries close to its rate."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from spmd_runtime.launch.link_delay import link_delay_unavailable
from spmd_runtime.launch.netns import NamespaceHosts, namespaces_unavailable

PORT = 29123
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


def measure(hosts: NamespaceHosts, rounds: int = 50, bulk_mib: int = 0) -> dict:
    server = hosts.popen(1, [sys.executable, "-c", SERVER, hosts.addresses[1], str(PORT)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        probe = hosts.run(0, [sys.executable, "-c", CLIENT, hosts.addresses[1], str(PORT),
                              str(rounds), str(bulk_mib)], capture_output=True, text=True,
                          timeout=120)
        assert probe.returncode == 0, probe.stderr[-2000:]
        return json.loads(probe.stdout)
    finally:
        server.kill()
        server.wait(10)


@pytest.fixture(scope="module")
def hosts():
    reason = namespaces_unavailable() or link_delay_unavailable()
    if reason:
        pytest.skip(reason)
    with NamespaceHosts(2) as made:
        yield made


def test_delay_on_both_hosts_adds_twice_the_delay_to_a_round_trip(hosts) -> None:
    base = measure(hosts)["rtt_ms"]
    for host in (0, 1):
        hosts.shape(host, "1gbit", delay_us=200)
    delayed = measure(hosts, bulk_mib=48)
    # No packet leaves early, so 0.4 ms is a hard floor; the ceiling is generous for a busy
    # machine, and the shaped link still carries most of its 125 MB/s.
    assert delayed["rtt_ms"] >= 0.4
    assert delayed["rtt_ms"] - base <= 0.4 + 1.5, (base, delayed)
    assert delayed["bulk_mb_s"] >= 40, delayed
    for host in (0, 1):
        hosts.shape(host, "1gbit")
    assert measure(hosts)["rtt_ms"] < delayed["rtt_ms"]     # removing the delay removes it
