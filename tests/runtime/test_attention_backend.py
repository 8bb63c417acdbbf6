"""How a worker picks its attention backend (runtime/layers/attention_backend.py), once, from
--attention-backend, its device, its dtype and whether the C++ library is built."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from cpu_library import needs_cpu_ops
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers import cpu_ops
from spmd_runtime.runtime.layers.attention_backend import (
    CPP,
    TORCH,
    TRITON,
    choose_attention_backend,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_worker_runs_the_cpp_library_in_float32_and_bfloat16(dtype) -> None:
    assert choose_attention_backend("auto", CPU, dtype, 64) is CPP
    assert choose_attention_backend("cpp", CPU, dtype, 64) is CPP
    assert choose_attention_backend("torch", CPU, dtype, 64) is TORCH
    assert CPP.fused_layers and CPP.reads_cache_in_place and not TORCH.fused_layers


def test_an_explicit_request_that_cannot_run_says_what_to_change() -> None:
    assert choose_attention_backend("auto", CPU, torch.float16, 64) is TORCH
    with pytest.raises(ValueError, match="use --attention-backend torch or auto"):
        choose_attention_backend("cpp", CPU, torch.float16, 64)
    with pytest.raises(ValueError, match="use --attention-backend torch or auto"):
        choose_attention_backend("cpp", CUDA, torch.bfloat16, 64)


def test_a_missing_build_stops_the_worker_naming_the_build_command(monkeypatch) -> None:
    """Never a silent fall-back to the slower torch path on a CPU the library is built for."""
    missing = cpu_ops.KernelLibrary(None, None, "the C++ CPU operators are not built for this "
                                    "CPU (avx2), ...: run spmdrun build-kernels")
    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    monkeypatch.setattr(cpu_ops, "loaded", lambda: missing)
    for requested in ("auto", "cpp"):
        with pytest.raises(ValueError, match="spmdrun build-kernels.*--attention-backend torch"):
            choose_attention_backend(requested, CPU, torch.float32, 64)
    # A CPU with no build level (no AVX2): auto serves on the torch path.
    monkeypatch.setattr(cpu_features, "detect", lambda: cpu_features.CpuFeatures(frozenset()))
    assert choose_attention_backend("auto", CPU, torch.float32, 64) is TORCH


def test_triton_runs_on_cuda_only_and_a_bad_request_says_what_to_change(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_attention_backend("auto", CPU, torch.float32, 64) is not TRITON
    assert choose_attention_backend("torch", CUDA, torch.bfloat16, 64) is TORCH
    with pytest.raises(ValueError, match="use --attention-backend torch or auto"):
        choose_attention_backend("triton", CPU, torch.float32, 64)
    if importlib.util.find_spec("triton") is not None:
        assert choose_attention_backend("auto", CUDA, torch.bfloat16, 64) is TRITON
        assert choose_attention_backend("auto", CUDA, torch.bfloat16, 48) is TORCH  # not 2^n


@pytest.mark.parametrize("requested", ["auto", "torch"])
def test_a_cuda_worker_keeps_sdpa_off_cudnn_whose_plans_are_built_per_shape(requested) -> None:
    """Packed prompt steps call SDPA once per prompt, with lengths that keep changing; cuDNN's
    attention builds a plan for each new shape (0.4-1.2 s prompt steps on an H200). Choosing a
    CUDA worker's backend, whichever, turns it off; a CPU worker's leaves the flag alone."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        choose_attention_backend(requested, CPU, torch.float32, 64)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        choose_attention_backend(requested, CUDA, torch.bfloat16, 64)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


@needs_cpu_ops
def test_the_cpp_backend_passes_sliding_windows_to_its_kernels() -> None:
    """decode's `starts` and fresh_prompt's `window` reach the C++ kernels; only the cpp
    backend says its one-call decode stack takes a window, and its schema does."""
    schema = torch.ops.spmd_cpu.decode_layers.default._schema
    assert CPP.windowed_decode_stack == ("starts" in [a.name for a in schema.arguments])
    assert CPP.windowed_decode_stack and not TORCH.windowed_decode_stack
    assert not TRITON.windowed_decode_stack
    torch.manual_seed(0)
    q, k_cache, v_cache = torch.randn(2, 4, 16), torch.randn(32, 2, 16), torch.randn(32, 2, 16)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    lengths = torch.tensor([9, 16], dtype=torch.int32)
    starts = torch.tensor([6, 1], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, lengths, 4, 0.25)
    windowed = CPP.decode(*args, starts=starts)
    assert torch.equal(windowed, torch.ops.spmd_cpu.paged_decode_attention(*args, starts))
    assert not torch.equal(windowed, CPP.decode(*args))
    prompt, k, v = torch.randn(10, 4, 16), k_cache[:10], v_cache[:10]
    if torch.backends.mkl.is_available():
        prefill = torch.ops.spmd_cpu.prefill_attention
        assert torch.equal(CPP.fresh_prompt(prompt, k, v, 0.25), prefill(prompt, k, v, 0.25))
        assert torch.equal(CPP.fresh_prompt(prompt, k, v, 0.25, window=3),
                           prefill(prompt, k, v, 0.25, 3))
    assert TORCH.fresh_prompt(prompt, k, v, 0.25, window=3) is None
