"""Checks of the Triton decode-attention kernel run by Triton's interpreter on CPU.

TRITON_INTERPRET=1 must be set before the kernel module is imported (triton.jit reads it when
the kernel is defined), so tests/runtime/test_triton_attention.py runs this file in a fresh
process: `python tests/runtime/triton_interpreted.py kernel|window|runner`.
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


def band_reference(q, k_cache, v_cache, tables, lengths, block_size, scale, window):
    """SDPA over each sequence's whole gathered context under an explicit band mask: the query
    at position p = length - 1 sees the keys p - window < j <= p."""
    out = torch.empty_like(q)
    for i, length in enumerate(lengths.tolist()):
        slots = torch.tensor([int(tables[i, t // block_size]) * block_size + t % block_size
                              for t in range(length)])
        band = torch.arange(length) > length - 1 - window
        out[i] = F.scaled_dot_product_attention(
            q[i][:, None], k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1),
            attn_mask=band, scale=scale, enable_gqa=True)[:, 0]
    return out


def check_window() -> None:
    """starts = max(length - window, 0) against SDPA under a band mask, for windows of one
    token, within a block, a block, a whole context (70) and past every context (all starts 0:
    the unwindowed output exactly); starts in the first, second and third 64-token tile. No
    block is shared between sequences, so each sequence's table entries of blocks before its
    start can be stale (-1 or far outside the cache) and its tokens before the start NaN:
    unread, the output unchanged."""
    torch.manual_seed(1)
    lengths = torch.tensor([1, 7, 33, 70, 130], dtype=torch.int32)
    for block_size, heads, kv_heads, dim in [(4, 4, 2, 16), (16, 9, 3, 64)]:
        width = -(-int(lengths.max()) // block_size)
        num_blocks = len(lengths) * width
        k_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
        v_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
        tables = torch.randperm(num_blocks).view(len(lengths), width).to(torch.int32)
        q = torch.randn(len(lengths), heads, dim)
        args = (k_cache, v_cache, tables, lengths, block_size, 0.125)
        for window in (1, 3, block_size, 70, 1000):
            starts = (lengths - window).clamp(min=0).to(torch.int32)
            out = triton_attention.paged_decode_attention(q, *args, starts)
            ref = band_reference(q, *args, window)
            err = (out - ref).abs().max().item()
            assert err < 1e-5, f"block {block_size} heads {heads}/{kv_heads} window {window}: {err}"
            stale, spoiled_k, spoiled_v = tables.clone(), k_cache.clone(), v_cache.clone()
            for i, start in enumerate(starts.tolist()):
                stale[i, :start // block_size] = -1 if i % 2 else 2 ** 31 - 1
                for t in range(start):
                    slot = int(tables[i, t // block_size]) * block_size + t % block_size
                    spoiled_k[slot], spoiled_v[slot] = float("nan"), float("nan")
            spoiled = triton_attention.paged_decode_attention(
                q, spoiled_k, spoiled_v, stale, lengths, block_size, 0.125, starts)
            assert torch.equal(spoiled, out), f"window {window}: read before the start"
        # The last window, 1000, starts every sequence at 0.
        assert torch.equal(out, triton_attention.paged_decode_attention(q, *args))
        assert torch.equal(out, TRITON.decode(q, *args, starts))
    print("window ok")


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
    {"kernel": check_kernel, "window": check_window, "runner": check_runner}[sys.argv[1]]()
