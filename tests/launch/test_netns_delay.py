"""Delayed links between namespace hosts (tests/netns_tools/link_delay.py): a delay of D on
each host's egress adds 2*D to a round trip, and a shaped link still carries close to its rate."""
from __future__ import annotations

import pytest
from netns_tools.link_delay import link_delay_unavailable, measure_link
from netns_tools.netns import NamespaceHosts, namespaces_unavailable


@pytest.fixture(scope="module")
def hosts():
    reason = namespaces_unavailable() or link_delay_unavailable()
    if reason:
        pytest.skip(reason)
    with NamespaceHosts(2) as made:
        yield made


def test_delay_on_both_hosts_adds_twice_the_delay_to_a_round_trip(hosts) -> None:
    base = measure_link(hosts)["rtt_ms"]
    for host in (0, 1):
        hosts.shape(host, "1gbit", delay_us=200)
    delayed = measure_link(hosts, bulk_mib=48)
    # No packet leaves early, so 0.4 ms is a hard floor; the ceiling is generous for a busy
    # machine, and the shaped link still carries most of its 125 MB/s.
    assert delayed["rtt_ms"] >= 0.4
    assert delayed["rtt_ms"] - base <= 0.4 + 1.5, (base, delayed)
    assert delayed["bulk_mb_s"] >= 40, delayed
    for host in (0, 1):
        hosts.shape(host, "1gbit")
    assert measure_link(hosts)["rtt_ms"] < delayed["rtt_ms"]     # removing the delay removes it
