"""Test tooling for multi-node jobs on one machine: hosts made of network namespaces, link
rate and delay, packet capture. Tests and bench/netns_links.py only; never installed."""
