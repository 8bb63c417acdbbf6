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

# Runs the kernel check with an interpreter in which a Triton tensor refuses to become a Python
# int. Triton <= 3.6's interpreter makes one with int() of a one-element array, which NumPy >= 2.4
# refuses (triton-lang/triton issue 9171), so a kernel that takes a range() bound from a loaded
# value fails there; newer interpreters squeeze the array first and hide that.
NO_TENSOR_INDEX = """
import runpy, sys
import triton.runtime.interpreter as interpreter

if not hasattr(interpreter, "_patch_lang_tensor"):
    print("no interpreter hook")
    sys.exit(0)

def refuse(tensor):
    raise TypeError(f"a Triton tensor used as a Python int: {tensor!r}")

patch_lang_tensor = interpreter._patch_lang_tensor

def patch_without_index(tensor, scope):
    patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", refuse)

interpreter._patch_lang_tensor = patch_without_index
sys.argv = sys.argv[1:3]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_interpreted(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))


@needs_triton
@pytest.mark.parametrize("check", ["kernel", "window", "runner"])
def test_interpreted(check: str) -> None:
    result = run_interpreted(str(SCRIPT), check)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{check} ok" in result.stdout


@needs_triton
@pytest.mark.parametrize("check", ["kernel", "window"])
def test_the_interpreted_kernel_turns_no_tensor_into_a_python_int(check: str) -> None:
    """Also with a window, whose first tile the kernel computes from a loaded start."""
    result = run_interpreted("-c", NO_TENSOR_INDEX, str(SCRIPT), check)
    if "no interpreter hook" in result.stdout:
        pytest.skip("this Triton's interpreter has no _patch_lang_tensor to hook")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{check} ok" in result.stdout
