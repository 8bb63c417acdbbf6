"""Decode attention that reads the paged KV cache in place on the CPU: a small C++ operator.

The torch path (runtime.layers.attention) gathers each decode group's context blocks into a
contiguous copy and runs SDPA over it, a group of a few sequences at a time: every context
token's K and V are read, written and read again, and a batch of 64 decodes costs 16 gathers
and 8 SDPA calls per layer. The operator in cpu_attention.cpp reads each token's K and V once,
from its slot, for the whole batch in one call, split over the intra-op threads by sequence.
It computes the same softmax(q k^T * scale) v in float32, for float32 or bfloat16 queries and
caches (bfloat16 rows widened as they are read, the output rounded back to bfloat16). It checks
its arguments (shapes, dtypes, every block-table entry a length reaches) and raises a
RuntimeError naming the bad one rather than reading outside the cache. With `starts` (a sliding
window) each sequence attends only its last tokens, and reads nothing before them.

It is built with the project's other CPU operators (runtime.layers.cpu_ops) the first time a
worker needs it; `load()` says whether it is usable.
"""
from __future__ import annotations

import torch
from spmd_runtime.runtime.layers.cpu_ops import load

__all__ = ["load", "paged_decode_attention"]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                           scale: float, starts: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, heads, dim], one query per sequence; caches: [slots, kv_heads, dim], all three
    float32 or all bfloat16; block_tables: [n, blocks] (int32 or int64; entries past a
    sequence's length are padding, never read); lengths: [n] int32 context tokens, each in
    [1, blocks * block_size]. starts: None (every context token), or [n] contiguous int32, each
    in [0, lengths[i]): sequence i attends its tokens starts[i] .. lengths[i] - 1 only (a window
    of W: max(lengths - W, 0)), and its table entries of blocks wholly before starts[i] are
    neither read nor checked. Returns [n, heads, dim] in q's dtype."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return torch.ops.spmd_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, lengths,
                                                     block_size, scale, starts)
