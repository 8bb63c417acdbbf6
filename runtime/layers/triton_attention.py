"""Decode attention that reads the paged KV cache in place: a Triton kernel.

The torch path (runtime.layers.attention) gathers each decode group's context blocks into a
contiguous copy and runs SDPA over it: per layer and step, every context token's K and V are
read, written and read again. This kernel reads them once, straight from their slots.

One program per (sequence, KV head) holds that head's query group (the query heads sharing the
KV head, padded to 16 rows for tl.dot) and walks the sequence's context TILE tokens at a time:
each token's slot comes from the block table (slot = block * block_size + offset), scores are
masked past the context length, and an online softmax (running max and sum, rescaled as the
max grows) accumulates the output in fp32. With `starts` (a sliding window) the walk begins at
the tile holding each sequence's first attended token and masks the tokens before it, so earlier
context is never read. The grid's shape depends only on the batch size and
the head count, so the launch is captured in a decode bucket's CUDA graph like any other.

Triton is optional (it comes with CUDA builds of torch); `available()` says whether the kernel
can run. With TRITON_INTERPRET=1 it runs on CPU tensors, which is how it is tested without a GPU;
there it walks the tiles with a while loop instead of the compiled for loop (see the kernel), the
same tile step either way.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

TILE = 64           # context tokens per inner-loop iteration
MIN_DOT = 16        # tl.dot wants every dimension >= 16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def available() -> bool:
    """Whether Triton is installed (CPU builds of torch ship without it); it is imported only
    when the kernel first runs."""
    return importlib.util.find_spec("triton") is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                           scale: float, starts: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, heads, dim], one query per sequence; caches: [slots, kv_heads, dim];
    block_tables: [n, blocks] (int32 or int64); lengths: [n] context tokens, each >= 1.
    starts: None, or [n] int32, each in [0, lengths[i]): sequence i attends its tokens
    starts[i] .. lengths[i] - 1 only, table entries of blocks before starts[i] unread (unchecked:
    a kernel launch cannot raise). Returns [n, heads, dim]."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    import triton
    from spmd_runtime.runtime.layers.paged_decode_kernel import paged_decode_kernel
    paged_decode_kernel[(num_seqs, kv_heads)](
        q, k_cache, v_cache, block_tables, lengths, lengths if starts is None else starts, out,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=TILE,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WHILE_LOOP=interpreting(),
        HAS_STARTS=starts is not None)
    return out
