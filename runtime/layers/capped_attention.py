"""Attention with tanh soft-capped scores (Gemma 2: cap * tanh(scores / cap) before the
softmax), in plain torch: SDPA, the C++ kernels and the Triton kernel compute softmax(scores)
alone, so runtime.layers.attention sends a capping model's whole batch here instead."""
from __future__ import annotations

import torch


def capped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """query [B, heads, Lq, d], keys and values [B, kv_heads, Lk, d], mask [B, 1, Lq, Lk] or
    [Lq, Lk] (True where a query may attend): [B, heads, Lq, d]. Softmax in float32."""
    batch, heads, length, dim = query.shape
    kv_heads = keys.shape[1]
    # Each key/value head serves heads // kv_heads query heads: group them instead of copying.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, length, dim)
    scores = torch.matmul(grouped, keys.unsqueeze(2).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    mask = (mask[None, None] if mask.dim() == 2 else mask).unsqueeze(1)   # [B, 1, 1, Lq, Lk]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values.unsqueeze(2)).view(batch, heads, length, dim)
