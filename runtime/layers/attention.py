"""Attention over a paged KV cache, for a batch that mixes decodes and (chunked) prefills.

The cache of one layer is a flat tensor of slots [num_blocks * block_size, kv_heads, head_dim];
slot = block_id * block_size + offset. Single-token queries (decodes) are batched into one call
over their gathered context in groups of similar length (less padding, and a group's keys stay in
cache); each multi-token chunk gets its own causal call. Context is gathered
a whole block at a time: copying rows of block_size * kv_heads * head_dim values is several
times faster than gathering token by token.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from spmd_runtime.runtime.layers.attention_backend import TORCH, AttentionBackend
from spmd_runtime.runtime.layers.capped_attention import capped_attention


@dataclass
class PrefillChunk:
    start: int                      # first token of the chunk in the flattened batch
    length: int
    context_blocks: torch.Tensor | None  # [num_blocks] blocks holding its context; None: fresh prompt
    # [length, num_blocks * block_size] True where a query may attend; for a fresh prompt, None
    # (causal) or, under a sliding window shorter than it, [length, length]
    mask: torch.Tensor | None
    first_key: int = 0              # position of the first token of context_blocks' first block
    position: int = 0               # position of the chunk's first token (its cached context)

    def to(self, device: torch.device) -> PrefillChunk:
        return replace(self, context_blocks=_to(self.context_blocks, device),
                       mask=_to(self.mask, device))


@dataclass
class DecodeGroup:
    start: int                      # first of `count` consecutive single-token queries
    count: int
    blocks: torch.Tensor            # [count * num_blocks] block tables, flattened, padded
    mask: torch.Tensor | None       # [count, 1, 1, num_blocks * block_size]; None: in place
    lengths: torch.Tensor | None = None   # [count] int32 context tokens (for the kernel)
    # Under a sliding window, [count] int32 first context token each query attends to (for the
    # kernel, which reads nothing before it)
    starts: torch.Tensor | None = None

    def to(self, device: torch.device) -> DecodeGroup:
        return replace(self, blocks=_to(self.blocks, device), mask=_to(self.mask, device),
                       lengths=_to(self.lengths, device), starts=_to(self.starts, device))


@dataclass
class AttentionBatch:
    """Everything attention needs about one step; built once and shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor      # [T] where each new token's K/V is written
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # Bucket padding: tokens from here on are padding no chunk or group covers (their K/V
    # goes to a scratch block); their output is zero.
    pad_start: int | None = None
    # Fresh prompts laid out one per row of this many positions (padding at each row's end),
    # each attending causally within its row: the fixed shape a prompt graph is captured
    # with. `decodes` and `prefills` are then empty.
    prompt_rows: int | None = None
    # The worker's attention backend (runtime/layers/attention_backend.py): how the KV write,
    # decode groups and fresh prompts attend.
    backend: AttentionBackend = TORCH
    # Sliding-window attention: each query attends to the last `window` tokens only (its own
    # included). A model mixing full-attention and windowed layers keeps their KV in block
    # tables of their own: the batch of its full-attention layers then carries the windowed
    # layers' batch as `sliding` (the same tokens; its own slots, tables and masks).
    window: int | None = None
    sliding: AttentionBatch | None = None

    def for_window(self, window: int | None) -> AttentionBatch:
        """The batch a layer with that window (None: full attention) attends with."""
        if window == self.window:
            return self
        if self.sliding is None or self.sliding.window != window:
            raise ValueError(f"this step's batch has no attention batch for window {window}")
        return self.sliding

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, in a fixed order (what a captured graph reads)."""
        found = [self.slot_mapping]
        for group in self.decodes:
            found += [t for t in (group.blocks, group.mask, group.lengths, group.starts)
                      if t is not None]
        for chunk in self.prefills:
            found += [t for t in (chunk.context_blocks, chunk.mask) if t is not None]
        if self.sliding is not None:
            found += self.sliding.tensors()
        return found

    def to(self, device: torch.device) -> AttentionBatch:
        """The same batch on `device`, copied without blocking the host (see _to)."""
        return replace(self, slot_mapping=_to(self.slot_mapping, device),
                       decodes=[group.to(device) for group in self.decodes],
                       prefills=[chunk.to(device) for chunk in self.prefills],
                       sliding=None if self.sliding is None else self.sliding.to(device))


def fresh_prompt_batch(length: int, layer_windows: list[int | None],
                       device: torch.device | None = None) -> AttentionBatch:
    """One fresh prompt of `length` tokens written to slots 0..length-1, for layers with these
    windows: the full-attention layers' batch, with the windowed layers' as its `sliding`
    (or a window on every layer: that one alone)."""
    def attention_batch(window: int | None) -> AttentionBatch:
        mask = band_mask(length, window, device)
        return AttentionBatch(block_size=length,
                              slot_mapping=torch.arange(length, device=device), decodes=[],
                              prefills=[PrefillChunk(0, length, None, mask)], window=window)

    windows = sorted(set(layer_windows), key=lambda window: window is not None)
    batch = attention_batch(windows[0])
    batch.sliding = attention_batch(windows[1]) if len(windows) > 1 else None
    return batch


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A host tensor on `device`. non_blocking: a blocking copy to a CUDA device waits for
    everything queued on the stream, the step still running included, before the host may go
    on; this one waits for nothing (a pageable source is staged by the driver before the call
    returns, so the host may reuse it)."""
    return None if tensor is None else tensor.to(device, non_blocking=True)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(blocks) * block_size, kv_heads, head_dim] context rows of the given blocks."""
    kv_heads, head_dim = cache.shape[1], cache.shape[2]
    by_block = cache.view(-1, block_size * kv_heads * head_dim)
    return by_block.index_select(0, blocks).view(-1, kv_heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, heads, dim], k/v: [T, kv_heads, dim] for the new tokens. Returns [T, heads, dim].
    With `softcap`, scores are soft-capped (cap * tanh(scores / cap)) in plain torch: no
    kernel or SDPA path computes that."""
    backend = batch.backend
    backend.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    if softcap is not None:
        return _capped_paged_attention(q, k, v, k_cache, v_cache, batch, scale, softcap)
    if batch.prompt_rows:
        return _attend_rows(q, k, v, batch.prompt_rows, scale, batch.window)
    out = torch.empty_like(q)
    if batch.pad_start is not None:
        out[batch.pad_start:].zero_()
    # One group of all the rows: the kernel's output is returned as it is (no copy into `out`).
    sole = batch.pad_start is None and len(batch.decodes) + len(batch.prefills) == 1
    bs = batch.block_size
    for group in batch.decodes:
        n = group.count
        rows = slice(group.start, group.start + n)
        if backend.reads_cache_in_place:
            attended = backend.decode(q[rows], k_cache, v_cache, group.blocks.view(n, -1),
                                      group.lengths, bs, scale, group.starts)
            if sole:
                return attended
            out[rows] = attended
            continue
        out[rows] = _gathered_decode(q[rows], k_cache, v_cache, group, bs, scale)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        query = q[rows].transpose(0, 1).unsqueeze(0)            # [1, heads, len, d]
        if chunk.context_blocks is None:
            attended = backend.fresh_prompt(q[rows], k[rows], v[rows], scale, batch.window)
        else:
            attended = backend.cached_prompt(q[rows], k_cache, v_cache, chunk.context_blocks,
                                             chunk.first_key, chunk.position, bs, scale,
                                             batch.window)
        if attended is not None and sole:
            return attended
        if attended is not None:
            out[rows] = attended
            continue
        if chunk.context_blocks is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                query, keys, values, is_causal=chunk.mask is None, attn_mask=chunk.mask,
                scale=scale, enable_gqa=True)
        else:
            keys = _gather_blocks(k_cache, chunk.context_blocks, bs).transpose(0, 1).unsqueeze(0)
            values = _gather_blocks(v_cache, chunk.context_blocks, bs).transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask,
                                                      scale=scale, enable_gqa=True)
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out


def _gathered_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     group: DecodeGroup, block_size: int, scale: float) -> torch.Tensor:
    """A decode group's attention through SDPA over gathered copies of its blocks."""
    n, kv_heads, dim = group.count, k_cache.shape[1], k_cache.shape[2]
    keys = _gather_blocks(k_cache, group.blocks, block_size).view(n, -1, kv_heads, dim)
    values = _gather_blocks(v_cache, group.blocks, block_size).view(n, -1, kv_heads, dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)      # [n, kv, L, d]
    attended = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=group.mask, scale=scale, enable_gqa=True)
    return attended.squeeze(2)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_length: int,
                 scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention within each row of `row_length` tokens (fresh prompts, one per row),
    within the last `window` tokens where given."""
    def by_row(x: torch.Tensor) -> torch.Tensor:             # [rows, heads, row_length, dim]
        return x.view(-1, row_length, x.shape[1], x.shape[2]).transpose(1, 2)

    mask = band_mask(row_length, window, q.device)
    attended = F.scaled_dot_product_attention(by_row(q), by_row(k), by_row(v),
                                              is_causal=mask is None, attn_mask=mask,
                                              scale=scale, enable_gqa=True)
    return attended.transpose(1, 2).reshape(q.shape)


def causal_mask(length: int, window: int | None = None,
                device: torch.device | None = None) -> torch.Tensor:
    """[length, length] True where query i may attend key j: j <= i, and i - j < window."""
    mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return mask.triu(1 - window) if window else mask


def band_mask(length: int, window: int | None,
              device: torch.device | None = None) -> torch.Tensor | None:
    """A fresh prompt's mask under a window shorter than it; None where plain causal
    attention is the same (no window, or one the prompt does not exceed)."""
    return causal_mask(length, window, device) if window and window < length else None


def _capped_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                            scale: float, cap: float) -> torch.Tensor:
    """paged_attention with soft-capped scores, every group and chunk through capped_attention:
    the same cache, masks and (for decode groups built for a kernel) context lengths."""
    if batch.prompt_rows:
        rows = batch.prompt_rows

        def by_row(x: torch.Tensor) -> torch.Tensor:             # [rows, heads, rows, dim]
            return x.view(-1, rows, x.shape[1], x.shape[2]).transpose(1, 2)

        attended = capped_attention(by_row(q), by_row(k), by_row(v),
                                    causal_mask(rows, batch.window, q.device), scale, cap)
        return attended.transpose(1, 2).reshape(q.shape)
    out = torch.zeros_like(q)
    bs, kv_heads, dim = batch.block_size, k.shape[1], k.shape[2]
    for group in batch.decodes:
        n = group.count
        keys = _gather_blocks(k_cache, group.blocks, bs).view(n, -1, kv_heads, dim)
        values = _gather_blocks(v_cache, group.blocks, bs).view(n, -1, kv_heads, dim)
        mask = group.mask
        if mask is None:        # built for a decode kernel: the context lengths (starts) tell
            context = torch.arange(keys.shape[1], device=q.device)
            mask = context < group.lengths.view(n, 1, 1, 1)
            if group.starts is not None:
                mask &= context >= group.starts.view(n, 1, 1, 1)
        rows = slice(group.start, group.start + n)
        out[rows] = capped_attention(q[rows].unsqueeze(2), keys.transpose(1, 2),
                                     values.transpose(1, 2), mask, scale, cap).squeeze(2)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        keys, values, mask = k[rows], v[rows], chunk.mask
        if chunk.context_blocks is None:
            mask = causal_mask(chunk.length, None, q.device) if mask is None else mask
        else:
            keys = _gather_blocks(k_cache, chunk.context_blocks, bs)
            values = _gather_blocks(v_cache, chunk.context_blocks, bs)
        attended = capped_attention(q[rows].transpose(0, 1).unsqueeze(0),
                                    keys.transpose(0, 1).unsqueeze(0),
                                    values.transpose(0, 1).unsqueeze(0), mask, scale, cap)
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out
