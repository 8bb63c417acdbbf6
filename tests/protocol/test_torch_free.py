"""The scheduler process and the wire protocol load no torch: a fresh interpreter importing
them has no 'torch' in sys.modules."""
from __future__ import annotations

import pkgutil
import subprocess
import sys

import spmd_runtime.protocol as protocol


def test_the_scheduler_process_and_the_protocol_import_no_torch() -> None:
    modules = ["spmd_runtime.scheduler_proc.server", "spmd_runtime.scheduler_proc.__main__",
               *(f"spmd_runtime.protocol.{m.name}" for m in pkgutil.iter_modules(protocol.__path__))]
    code = (f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
            "print(loaded[:5])\nsys.exit(1 if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"torch loaded: {done.stdout}{done.stderr}"
    assert "spmd_runtime.protocol.buckets" in modules
