"""Prompt chunks over cached context on the C++ CPU library's bf16 tiles
(spmd_cpu::prefill_attention_paged, cpu_prefill_attention.cpp): against SDPA over the gathered
blocks under the causal (and band) mask, equal to the fresh-prompt kernel where there is no
context, how it refuses bad arguments, and that the C++ backend takes it for bf16 only (the engine
in prefill chunks: tests/runtime/test_llm_correctness.py). Every assertion here is about
bfloat16: the kernel runs no other dtype."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_library import needs_cpu_ops
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers.attention import PrefillChunk
from spmd_runtime.runtime.layers.attention_backend import CPP, paged_prompt_supported

# Where the CPU has AVX512-BF16 the library's level has the tiles: a build without them fails
# here rather than skipping.
CPU_HAS_BF16 = "avx512_bf16" in cpu_features.detect().flags
needs_tiles = pytest.mark.skipif(not CPU_HAS_BF16, reason="this CPU has no AVX512-BF16: the "
                                 "library has no bf16 tiles for it")


@needs_cpu_ops
def test_the_library_says_where_it_has_the_tiles() -> None:
    assert paged_prompt_supported(64) == paged_prompt_supported(128) == CPU_HAS_BF16
    assert not paged_prompt_supported(80)


def chunk_case(tokens, context, heads, kv_heads, dim, block_size, window, index_dtype=torch.int64):
    """Caches of 50 shuffled blocks holding a sequence of context + tokens positions, the
    chunk's queries, and its PrefillChunk as the worker builds it (blocks from the first one a
    window reaches)."""
    torch.manual_seed(context * 7 + tokens)
    k_cache = (torch.randn(50 * block_size, kv_heads, dim) * 2).bfloat16()
    v_cache = torch.randn(50 * block_size, kv_heads, dim).bfloat16()
    table = torch.randperm(50)[:-(-(context + tokens) // block_size)]
    first_block = max(0, context - window + 1) // block_size if window else 0
    q = (torch.randn(tokens, heads, dim) * 2).bfloat16()
    chunk = PrefillChunk(0, tokens, table[first_block:].to(index_dtype), None,
                         first_key=first_block * block_size, position=context)
    return q, k_cache, v_cache, table, chunk


def gathered_sdpa(q, k_cache, v_cache, table, chunk, block_size, window):
    """float32 SDPA over the chunk's blocks gathered, under the causal (and band) mask."""
    slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size)
                       for b in chunk.context_blocks.tolist()])
    keys = torch.arange(chunk.first_key, chunk.first_key + len(slots))[None, :]
    positions = torch.arange(chunk.position, chunk.position + q.shape[0])[:, None]
    mask = keys <= positions
    if window:
        mask &= keys > positions - window
    by_head = lambda x: x.float().transpose(0, 1).unsqueeze(0)      # noqa: E731
    return F.scaled_dot_product_attention(
        by_head(q), by_head(k_cache[slots]), by_head(v_cache[slots]), attn_mask=mask,
        scale=q.shape[-1] ** -0.5, enable_gqa=True).squeeze(0).transpose(0, 1)


def attend(q, k_cache, v_cache, chunk, block_size, window):
    return torch.ops.spmd_cpu.prefill_attention_paged(
        q, k_cache, v_cache, chunk.context_blocks, block_size, chunk.first_key, chunk.position,
        q.shape[-1] ** -0.5, window)


# (tokens, context, heads, kv_heads, dim, block_size, window): a lone query after a long
# context, chunks shorter and longer than a 32-query block, unaligned contexts, groups of 1-4,
# head sizes 64 and 128, and windows inside the chunk, across it and past everything.
CASES = [(1, 700, 9, 3, 64, 16, 0), (5, 3, 9, 3, 64, 16, 0), (100, 300, 9, 3, 64, 16, 0),
         (33, 64, 8, 2, 128, 4, 0), (70, 130, 9, 3, 64, 16, 50), (64, 500, 4, 1, 128, 16, 33),
         (40, 17, 6, 6, 64, 8, 7), (20, 45, 9, 3, 64, 16, 1), (30, 20, 9, 3, 64, 16, 5000)]


@needs_cpu_ops
@needs_tiles
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cached_prompt_equals_sdpa_over_the_gathered_context(case, index_dtype) -> None:
    """bf16: within the bound of tests/runtime/test_cpu_attention.py's bf16 prompts (output
    rounded once, softmax weights rounded to bf16)."""
    *shape, block_size, window = case
    q, k_cache, v_cache, table, chunk = chunk_case(*shape, block_size, window, index_dtype)
    got = attend(q, k_cache, v_cache, chunk, block_size, window)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    expected = gathered_sdpa(q, k_cache, v_cache, table, chunk, block_size, window)
    atol = 2 ** -8 * v_cache.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -8, atol=atol)


@needs_cpu_ops
@needs_tiles
@pytest.mark.parametrize("window", [0, 7, 45])
def test_a_chunk_without_context_is_the_fresh_prompt_kernel_exactly(window) -> None:
    """Position 0: the same keys packed from the cache as from k and v, the same tiles: the
    same bits as spmd_cpu::prefill_attention."""
    tokens, block_size = 77, 16
    q, k_cache, v_cache, table, chunk = chunk_case(tokens, 0, 9, 3, 64, block_size, window)
    slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size)
                       for b in table.tolist()])[:tokens]
    fresh = torch.ops.spmd_cpu.prefill_attention(q, k_cache[slots], v_cache[slots], 0.125, window)
    assert torch.equal(attend(q, k_cache, v_cache, chunk, block_size, window), fresh)


def bad_cases():
    """id -> (a change to valid arguments, the message the kernel must raise)."""
    def with_(**changes):
        return lambda args: {**args, **changes}
    return {
        "float32": (lambda a: {**a, "q": a["q"].float(), "k_cache": a["k_cache"].float(),
                               "v_cache": a["v_cache"].float()}, "runs bfloat16"),
        "head size 80": (lambda a: {**a, "q": a["q"][..., :80].contiguous()}, "head_dim"),
        "cache dtype": (lambda a: {**a, "v_cache": a["v_cache"].float()}, "v_cache"),
        "block outside the cache": (lambda a: {**a, "blocks": a["blocks"].clone().fill_(50)},
                                    r"blocks\[0\] = 50 is outside the cache's 50 blocks"),
        "negative block": (lambda a: {**a, "blocks": a["blocks"].clone().fill_(-1)},
                           r"blocks\[0\] = -1"),
        "too few blocks": (lambda a: {**a, "blocks": a["blocks"][:2]}, "blocks holds 2 blocks"),
        "float blocks": (lambda a: {**a, "blocks": a["blocks"].float()}, "int32 or int64"),
        "unaligned first key": (with_(first_key=3), "multiple of block_size"),
        "position before first key": (with_(first_key=32, position=16), "is before first_key"),
        "block size": (with_(block_size=7), "block_size 7"),
        "negative window": (with_(window=-1), "window -1"),
        "kv heads": (lambda a: {**a, "q": a["q"][:, :8].contiguous()}, "KV heads"),
    }


@needs_cpu_ops
@needs_tiles
@pytest.mark.parametrize("name", list(bad_cases()))
def test_cached_prompt_refuses_bad_arguments_naming_them(name) -> None:
    change, match = bad_cases()[name]
    q, k_cache, v_cache, _, chunk = chunk_case(20, 40, 9, 3, 128, 16, 0)
    args = change({"q": q, "k_cache": k_cache, "v_cache": v_cache, "blocks": chunk.context_blocks,
                   "block_size": 16, "first_key": chunk.first_key, "position": chunk.position,
                   "scale": 0.1, "window": 0})
    with pytest.raises(RuntimeError, match=match):
        torch.ops.spmd_cpu.prefill_attention_paged(*args.values())


@needs_cpu_ops
@needs_tiles
def test_the_cpp_backend_takes_the_tiles_for_bf16_and_leaves_float32_to_sdpa() -> None:
    q, k_cache, v_cache, _, chunk = chunk_case(10, 20, 9, 3, 64, 16, 0)
    where = (chunk.context_blocks, chunk.first_key, chunk.position, 16, 0.125)
    assert CPP.cached_prompt(q, k_cache, v_cache, *where) is not None
    assert CPP.cached_prompt(q.float(), k_cache.float(), v_cache.float(), *where) is None
