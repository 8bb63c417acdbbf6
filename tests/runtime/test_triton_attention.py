"""The Triton decode-attention kernel, run by Triton's interpreter on CPU (in a fresh process,
see triton_interpreted.py). On a CUDA machine the same kernel is compiled and
tests/runtime/test_bucketing_engine.py compares whole engines."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed")

SCRIPT = Path(__file__).with_name("triton_interpreted.py")


@needs_triton
@pytest.mark.parametrize("check", ["kernel", "runner"])
def test_interpreted(check: str) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), check], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{check} ok" in result.stdout
