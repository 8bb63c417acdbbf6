"""Soft-capped attention over the paged KV cache (runtime/layers/capped_attention.py, reached
through runtime.layers.attention.paged_attention's softcap): every group and chunk of a batch
equals causal attention over each sequence's whole K/V, scores capped as cap * tanh(s / cap)."""
from __future__ import annotations

import pytest
import torch
from spmd_runtime.runtime.layers.attention import (
    AttentionBatch,
    DecodeGroup,
    PrefillChunk,
    paged_attention,
)
from spmd_runtime.runtime.layers.attention_backend import TORCH, TRITON

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
SCALE, CAP = 0.5, 2.0


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
              cap: float | None) -> torch.Tensor:
    """Queries q [n, heads, dim] at `positions`, causal over keys/values [L, kv_heads, dim]."""
    k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * SCALE
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    visible = torch.arange(len(keys))[None, :] <= torch.tensor(positions)[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


def slots(blocks: list[int], positions: range) -> list[int]:
    return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


# "triton": decode groups as built for the kernel, which the capped path reads itself (cap None
# would run the kernel, which needs a GPU).
@pytest.mark.parametrize(("backend", "cap"), [(TORCH, CAP), (TRITON, CAP), (TORCH, None)],
                         ids=["torch-capped", "triton-capped", "torch"])
def test_decodes_and_chunks_equal_causal_attention_over_the_whole_sequence(
        backend, cap) -> None:
    """One decode (context 6), a chunk of 3 after 5 cached tokens and a fresh prompt of 4, in
    one batch; decode groups with a mask, or with context lengths. cap None: the usual path
    (SDPA), uncapped."""
    g = torch.Generator().manual_seed(0)
    # (blocks, cached tokens, new tokens) per sequence.
    sequences = [([1, 3], 5, 1), ([0, 2], 5, 3), ([4], 0, 4)]
    k_cache = torch.zeros(6 * BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    full, new_q, new_k, new_v, slot_mapping = [], [], [], [], []
    for blocks, cached, new in sequences:
        keys, values = (torch.randn(cached + new, KV_HEADS, DIM, generator=g) for _ in range(2))
        known = torch.tensor(slots(blocks, range(cached)), dtype=torch.long)
        k_cache[known], v_cache[known] = keys[:cached], values[:cached]
        full.append((keys, values))
        new_q.append(torch.randn(new, HEADS, DIM, generator=g))
        new_k.append(keys[cached:])
        new_v.append(values[cached:])
        slot_mapping += slots(blocks, range(cached, cached + new))
    context = torch.arange(2 * BLOCK)
    if backend.reads_cache_in_place:
        decode = DecodeGroup(0, 1, torch.tensor([1, 3], dtype=torch.int32), None,
                             torch.tensor([6], dtype=torch.int32))
    else:
        decode = DecodeGroup(0, 1, torch.tensor([1, 3]), (context < 6).view(1, 1, 1, -1))
    chunk_mask = context[None, :] <= torch.arange(5, 8)[:, None]
    batch = AttentionBatch(BLOCK, torch.tensor(slot_mapping), [decode],
                           [PrefillChunk(1, 3, torch.tensor([0, 2]), chunk_mask),
                            PrefillChunk(4, 4, None, None)], backend=backend)
    out = paged_attention(torch.cat(new_q), torch.cat(new_k), torch.cat(new_v), k_cache, v_cache,
                          batch, SCALE, cap)
    expected = torch.cat([reference(q, *kv, list(range(cached, cached + new)), cap)
                          for q, kv, (_, cached, new) in zip(new_q, full, sequences, strict=True)])
    assert torch.allclose(out, expected, atol=1e-5), float((out - expected).abs().max())


def test_prompt_rows_attend_causally_within_their_row() -> None:
    """Fresh prompts laid out one per row (a captured prompt graph's layout)."""
    g = torch.Generator().manual_seed(1)
    rows, length = 2, 4
    q = torch.randn(rows * length, HEADS, DIM, generator=g)
    k, v = (torch.randn(rows * length, KV_HEADS, DIM, generator=g) for _ in range(2))
    cache = torch.zeros(rows * length, KV_HEADS, DIM)
    batch = AttentionBatch(BLOCK, torch.arange(rows * length), [], [], prompt_rows=length)
    out = paged_attention(q, k, v, cache, cache.clone(), batch, SCALE, CAP)
    for row in range(rows):
        part = slice(row * length, (row + 1) * length)
        expected = reference(q[part], k[part], v[part], list(range(length)), CAP)
        assert torch.allclose(out[part], expected, atol=1e-5)
