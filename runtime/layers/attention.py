"""Attention over a paged KV cache, for a batch that mixes decodes and (chunked) prefills.

The cache of one layer is a flat tensor of slots [num_blocks * block_size, kv_heads, head_dim];
slot = block_id * block_size + offset. Single-token queries (decodes) are batched into one call
over their gathered context; each multi-token chunk gets its own causal call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int                      # first token of the chunk in the flattened batch
    length: int
    context_slots: torch.Tensor | None  # slots of all context tokens; None for a fresh prompt
    mask: torch.Tensor | None       # [length, context] True where a query may attend


@dataclass
class AttentionBatch:
    """Everything attention needs about one step; built once and shared by every layer."""

    slot_mapping: torch.Tensor      # [T] where each new token's K/V is written
    num_decode: int                 # the first num_decode tokens are single-token queries
    decode_slots: torch.Tensor | None   # [num_decode, max_context] (padding points at slot 0)
    decode_mask: torch.Tensor | None    # [num_decode, 1, 1, max_context]
    prefills: list[PrefillChunk]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [T, heads, dim], k/v: [T, kv_heads, dim] for the new tokens. Returns [T, heads, dim]."""
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    n = batch.num_decode
    if n:
        keys = k_cache[batch.decode_slots].transpose(1, 2)      # [n, kv, L, d]
        values = v_cache[batch.decode_slots].transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q[:n].unsqueeze(2), keys, values, attn_mask=batch.decode_mask, scale=scale,
            enable_gqa=True)
        out[:n] = attended.squeeze(2)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        query = q[rows].transpose(0, 1).unsqueeze(0)            # [1, heads, len, d]
        if chunk.context_slots is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                      scale=scale, enable_gqa=True)
        else:
            keys = k_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
            values = v_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask,
                                                      scale=scale, enable_gqa=True)
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out
