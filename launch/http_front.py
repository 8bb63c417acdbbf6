"""The HTTP front beside the engine: a child process of the launcher, supervised like the others."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

from spmd_runtime.launch.engine import spawn_child
from spmd_runtime.launch.supervisor import Supervisor
from spmd_runtime.protocol.config import EngineConfig

# Where to reach a front bound to a wildcard address from this machine.
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def http_url(config: EngineConfig) -> str:
    host = _WILDCARDS.get(config.http_host, config.http_host)
    return f"http://[{host}]:{config.http_port}" if ":" in host else f"http://{host}:{config.http_port}"


def start_http_front(config: EngineConfig, supervisor: Supervisor, alive: Callable[[], bool],
                     timeout_s: float = 300.0) -> str:
    """Spawn `python -m spmd_runtime.runtime.serving` for the engine at config.rpc_address and wait until its
    /health answers; returns its URL. Raises RuntimeError when it does not come up."""
    supervisor.add("http front", spawn_child("spmd_runtime.runtime.serving", config))
    url = http_url(config)
    deadline = time.monotonic() + timeout_s
    while True:
        supervisor.check()   # raises ChildExited if the front (or anything else) died
        if not alive():
            raise RuntimeError("the engine stopped while the HTTP front started")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return url
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP front did not answer on {url} within {timeout_s:.0f}s")
        time.sleep(0.2)
