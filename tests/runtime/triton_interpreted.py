"""Checks of the Triton decode-attention kernel run by Triton's interpreter on CPU.

TRITON_INTERPRET=1 must be set before the kernel module is imported (triton.jit reads it when
the kernel is defined), so tests/runtime/test_triton_attention.py runs this file in a fresh
process: `python tests/runtime/triton_interpreted.py kernel|runner`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).parents[1]),
                 str(Path(__file__).parents[1] / "worker_proc")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from spmd_runtime.runtime.layers import triton_attention  # noqa: E402
from spmd_runtime.runtime.layers.attention_backend import TRITON  # noqa: E402


def check_kernel() -> None:
    """Against SDPA over each sequence's gathered context, for several head layouts, block
    sizes and context lengths (1 token, partial tiles, several tiles, blocks out of order)."""
    torch.manual_seed(0)
    for block_size, heads, kv_heads, dim in [(4, 4, 2, 16), (16, 9, 3, 64), (16, 32, 8, 64),
                                             (8, 8, 8, 32)]:
        num_blocks = 40
        k_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
        v_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
        lengths = torch.tensor([1, 7, 33, 70, 130])
        width = -(-int(lengths.max()) // block_size)
        tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lengths])
        q = torch.randn(len(lengths), heads, dim)
        out = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables.to(torch.int32),
                                                      lengths.to(torch.int32), block_size, 0.125)
        for i, length in enumerate(lengths.tolist()):
            slots = torch.tensor([int(tables[i, t // block_size]) * block_size + t % block_size
                                  for t in range(length)])
            ref = F.scaled_dot_product_attention(
                q[i][:, None], k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1),
                scale=0.125, enable_gqa=True)[:, 0]
            err = (out[i] - ref).abs().max().item()
            assert err < 1e-5, f"block {block_size} heads {heads}/{kv_heads} dim {dim} seq {i}: {err}"
    print("kernel ok")


def check_runner() -> None:
    """The model runner's tokens with the kernel equal its tokens with the torch path, eager
    and through (emulated) bucket graphs."""
    import test_graphs as graphs
    from test_model_runner import build_pair

    _, model, config = build_pair(seed=3)
    expected = graphs.run_workload(graphs.make_runner(model, config))
    kernel = graphs.make_runner(model, config)
    kernel.attention = TRITON
    assert graphs.run_workload(kernel) == expected
    captured = graphs.make_runner(model, config)
    captured.attention = TRITON
    graphs.capture_all(captured)
    assert graphs.run_workload(captured) == expected
    print("runner ok")


if __name__ == "__main__":
    {"kernel": check_kernel, "runner": check_runner}[sys.argv[1]]()
