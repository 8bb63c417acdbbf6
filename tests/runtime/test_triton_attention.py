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
import torch
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.worker_proc.worker import use_decode_kernel

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


def test_the_kernel_is_chosen_on_cuda_only_and_a_bad_request_says_what_to_change(
        monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    # On CPU, auto never picks Triton (the C++ kernel or the torch path: test_cpu_attention.py).
    assert use_decode_kernel(EngineConfig(), cpu, 64) != "triton"
    assert use_decode_kernel(EngineConfig(attention_backend="torch"), torch.device("cuda"), 64) == ""
    with pytest.raises(ValueError, match="use --attention-backend torch or auto"):
        use_decode_kernel(EngineConfig(attention_backend="triton"), cpu, 64)
    if importlib.util.find_spec("triton") is not None:
        assert use_decode_kernel(EngineConfig(), torch.device("cuda"), 64) == "triton"
        assert use_decode_kernel(EngineConfig(), torch.device("cuda"), 48) == ""   # not a power of 2
