"""Waiting for an engine under test to go idle (nothing running or waiting)."""
from __future__ import annotations

import time

from spmd_runtime.runtime.client import Client


def wait_idle(client: Client, timeout_s: float = 60.0):
    """Poll stats() until no request is running or waiting; returns those stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.05)
