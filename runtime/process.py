"""Starting child Python processes that cannot outlive their parent."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends SIGTERM when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def spawn_python(module: str, args: list[str], env: dict[str, str] | None = None,
                 stdout=None, stderr=None) -> subprocess.Popen:
    """Start `python -m module args` (module under the installed spmd_runtime namespace) with
    this environment plus `env`. Secrets (the engine config) go in `env`, never in `args`:
    every user of the machine can read a process's arguments."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.Popen([sys.executable, "-m", module, *args], env=full_env,
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
