"""Decode attention that reads the paged KV cache in place: a Triton kernel.

The torch path (runtime.layers.attention) gathers each decode group's context blocks into a
contiguous copy and runs SDPA over it: per layer and step, every context token's K and V are
read, written and read again. This kernel reads them once, straight from their slots.

One program per (sequence, KV head) holds that head's query group (the query heads sharing the
KV head, padded to 16 rows for tl.dot) and walks the sequence's context TILE tokens at a time:
each token's slot comes from the block table (slot = block * block_size + offset), scores are
masked past the context length, and an online softmax (running max and sum, rescaled as the
max grows) accumulates the output in fp32. The grid's shape depends only on the batch size and
the head count, so the launch is captured in a decode bucket's CUDA graph like any other.

Triton is optional (it comes with CUDA builds of torch); `available()` says whether the kernel
can run. With TRITON_INTERPRET=1 it runs on CPU tensors, which is how it is tested without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                     # CPU builds of torch ship without it
    triton = None

TILE = 64           # context tokens per inner-loop iteration
MIN_DOT = 16        # tl.dot wants every dimension >= 16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, lengths_ptr,
                             out_ptr, scale, stride_qb, stride_qh, stride_cs, stride_ch,
                             stride_bt, stride_ob, stride_oh,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             TILE: tl.constexpr, PRECISION: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        heads = kv_head * GROUP + rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        length = tl.load(lengths_ptr + seq)
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, length, TILE):
            tokens = start + tl.arange(0, TILE)
            token_ok = tokens < length
            blocks = tl.load(block_tables_ptr + seq * stride_bt + tokens // BLOCK_SIZE,
                             mask=token_ok, other=0)
            slots = blocks.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
            offsets = slots[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=token_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(token_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            weights = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            v = tl.load(v_cache_ptr + offsets, mask=token_ok[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q: [n, heads, dim], one query per sequence; caches: [slots, kv_heads, dim];
    block_tables: [n, blocks] (int32 or int64); lengths: [n] context tokens, each >= 1.
    Returns [n, heads, dim]."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    _paged_decode_kernel[(num_seqs, kv_heads)](
        q, k_cache, v_cache, block_tables, lengths, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=TILE,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
