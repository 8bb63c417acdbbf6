"""The C++ decode-attention kernel (runtime/layers/cpu_attention.cpp) and the causal prefill
attention (cpu_prefill_attention.cpp) against SDPA, in float32 and bfloat16, how every entry
point refuses bad arguments (naming them) instead of reading or writing outside its tensors,
and how a worker picks them. The runner-level check (its tokens equal the torch path's, eager
and through emulated bucket graphs) is in tests/worker_proc/test_graphs.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_library import needs_cpu_ops as needs_kernel
from spmd_runtime.runtime.layers import cpu_attention


def reference(q, k_cache, v_cache, tables, lengths, block_size, scale, window=None):
    """SDPA over each sequence's whole gathered context; with `window`, under an explicit band
    mask: the query at position p = length - 1 sees the keys p - window < j <= p."""
    out = torch.empty_like(q)
    for i, length in enumerate(lengths.tolist()):
        slots = torch.tensor([int(tables[i, t // block_size]) * block_size + t % block_size
                              for t in range(length)])
        band = None if window is None else torch.arange(length) > length - 1 - window
        out[i] = F.scaled_dot_product_attention(
            q[i][:, None], k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1),
            attn_mask=band, scale=scale, enable_gqa=True)[:, 0]
    return out


def window_starts(lengths, window):
    """The first token a window of `window` positions leaves each sequence: [n] int32."""
    return (lengths - window).clamp(min=0).to(torch.int32)


# (block_size, heads, kv_heads, dim): fixed-size paths (dims 64 and 128, groups 1-8; on
# AVX512-BF16 builds bf16 value sums in one pass up to groups of 6 and 3, in slices beyond) and
# the generic loop (dims 16, 32, 80).
DECODE_SHAPES = [(4, 4, 2, 16), (16, 9, 3, 64), (16, 32, 8, 64), (8, 8, 8, 32), (16, 4, 1, 80),
                 (16, 8, 2, 128), (16, 6, 1, 64), (4, 6, 3, 128), (16, 14, 2, 64),
                 (16, 16, 2, 128)]


def decode_case(block_size, heads, kv_heads, dim, index_dtype, dtype=torch.float32):
    """q, caches (of `dtype`), tables, lengths: 1-token contexts, partial last blocks, many
    blocks, blocks out of order, and table entries past the context (padding)."""
    torch.manual_seed(0)
    num_blocks = 40
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    lengths = torch.tensor([1, 7, block_size, 33, 70, 130], dtype=torch.int32)
    width = -(-int(lengths.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lengths]).to(index_dtype)
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    return q, k_cache, v_cache, tables, lengths


@needs_kernel
@pytest.mark.parametrize("block_size,heads,kv_heads,dim", DECODE_SHAPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_equals_sdpa_over_the_gathered_context(block_size, heads, kv_heads, dim,
                                                      index_dtype) -> None:
    """float32: the kernel's output equals SDPA's over the gathered context to float32
    rounding; padding table entries are not read into the result."""
    q, k_cache, v_cache, tables, lengths = decode_case(block_size, heads, kv_heads, dim,
                                                       index_dtype)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, block_size,
                                               dim ** -0.5)
    expected = reference(q, k_cache, v_cache, tables, lengths, block_size, dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_size,heads,kv_heads,dim", DECODE_SHAPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_bf16_kernel_equals_float32_attention_of_the_widened_values(block_size, heads, kv_heads,
                                                                    dim, index_dtype) -> None:
    """bfloat16 q and caches, read in place and summed in float32: the bfloat16 output is the
    float32 SDPA of the same values widened, to assert_bf16_attention_close's bound."""
    q, k_cache, v_cache, tables, lengths = decode_case(block_size, heads, kv_heads, dim,
                                                       index_dtype, torch.bfloat16)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, block_size,
                                               dim ** -0.5)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), tables, lengths,
                         block_size, dim ** -0.5)
    assert out.dtype == torch.bfloat16
    assert_bf16_attention_close(out, expected, v_cache)


# 1 token; 3: within a block; 7: a whole context (lengths[1]); 16: a block of the 16-slot shapes
# (and lengths[2]); 33: across blocks, unaligned; 1000: past every context (no window).
WINDOWS = [1, 3, 7, 16, 33, 1000]


@needs_kernel
@pytest.mark.parametrize("block_size,heads,kv_heads,dim", DECODE_SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_kernel_equals_sdpa_under_a_band_mask(block_size, heads, kv_heads, dim, window,
                                                       dtype) -> None:
    """starts = max(length - window, 0): the kernel's output is SDPA's over the whole gathered
    context under the band mask (float32 to float32 rounding; bfloat16 against the float32
    attention of the widened values, as above)."""
    q, k_cache, v_cache, tables, lengths = decode_case(block_size, heads, kv_heads, dim,
                                                       torch.int32, dtype)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, block_size,
                                               dim ** -0.5, window_starts(lengths, window))
    expected = reference(q.float(), k_cache.float(), v_cache.float(), tables, lengths,
                         block_size, dim ** -0.5, window)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_attention_close(out, expected, v_cache)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_starts_of_zero_are_no_window(dtype) -> None:
    """A window as long as every context (starts all 0) gives the unwindowed output exactly."""
    q, k_cache, v_cache, tables, lengths = decode_case(16, 9, 3, 64, torch.int32, dtype)
    args = (q, k_cache, v_cache, tables, lengths, 16, 0.125)
    assert torch.equal(cpu_attention.paged_decode_attention(*args, window_starts(lengths, 130)),
                       cpu_attention.paged_decode_attention(*args))


def disjoint_case(block_size, index_dtype, dtype):
    """decode_case's shapes with no block shared between sequences, so that a sequence's
    tokens before its start can be spoiled without touching another's window."""
    q, _, _, _, lengths = decode_case(block_size, 4, 2, 16, index_dtype, dtype)
    width = -(-int(lengths.max()) // block_size)
    num_blocks = len(lengths) * width
    k_cache = torch.randn(num_blocks * block_size, 2, 16).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, 2, 16).to(dtype)
    tables = torch.randperm(num_blocks).view(len(lengths), width).to(index_dtype)
    return q, k_cache, v_cache, tables, lengths


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("window", [3, 5, 33])
def test_windowed_kernel_neither_checks_nor_reads_what_lies_before_the_start(dtype, index_dtype,
                                                                             window) -> None:
    """Table entries of blocks wholly before a sequence's start (here -1 or far outside the
    cache, as freed blocks may leave them) pass unchecked, and the cache rows of its tokens
    before the start (here NaN) are not read: the output equals that of the intact table and
    cache, exactly."""
    block_size = 4
    q, k_cache, v_cache, tables, lengths = disjoint_case(block_size, index_dtype, dtype)
    starts = window_starts(lengths, window)
    huge = torch.iinfo(index_dtype).max
    stale, spoiled_k, spoiled_v = tables.clone(), k_cache.clone(), v_cache.clone()
    for i, start in enumerate(starts.tolist()):
        stale[i, :start // block_size] = -1 if i % 2 else huge
        for t in range(start):
            slot = int(tables[i, t // block_size]) * block_size + t % block_size
            spoiled_k[slot], spoiled_v[slot] = float("nan"), float("nan")
    assert (stale != tables).any()
    expected = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths,
                                                    block_size, 0.25, starts)
    got = cpu_attention.paged_decode_attention(q, spoiled_k, spoiled_v, stale, lengths,
                                               block_size, 0.25, starts)
    assert torch.equal(got, expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_neither_checks_nor_reads_table_padding(dtype) -> None:
    """Entries past a sequence's length (here far outside the cache, and negative) are
    padding: the kernel accepts them and its output (of `dtype`) is that of a table whose
    padding is valid, exactly."""
    q, k_cache, v_cache, tables, lengths = decode_case(4, 4, 2, 16, torch.int64, dtype)
    garbage = tables.clone()
    for i, length in enumerate(lengths.tolist()):
        garbage[i, -(-length // 4):] = -7 if i % 2 else 10 ** 12
    args = (k_cache, v_cache)
    assert torch.equal(cpu_attention.paged_decode_attention(q, *args, garbage, lengths, 4, 0.25),
                       cpu_attention.paged_decode_attention(q, *args, tables, lengths, 4, 0.25))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_strided_queries(dtype) -> None:
    """q (of `dtype`) a view with a row stride, as after a split: the output equals that of
    the contiguous copy, exactly."""
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(64, 2, 16).to(dtype), torch.randn(64, 2, 16).to(dtype)
    tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    lengths = torch.tensor([5, 8], dtype=torch.int32)
    q = torch.randn(2, 4, 32).to(dtype)[..., :16]
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 4, 0.25)
    assert torch.equal(out, cpu_attention.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, tables, lengths, 4, 0.25))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_makes_the_copies_index_copy_makes_and_refuses_bad_slots(dtype) -> None:
    """k, v and caches of `dtype`: the caches afterwards equal index_copy_'s, bit for bit."""
    torch.manual_seed(2)
    k_cache, v_cache = torch.randn(256, 3, 16).to(dtype), torch.randn(256, 3, 16).to(dtype)
    qkv = torch.randn(40, 9 * 16).to(dtype)     # k and v as strided views of a fused output
    k, v = qkv[:, 48:96].view(40, 3, 16), qkv[:, 96:].view(40, 3, 16)
    slots = torch.randperm(256)[:40]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.index_copy_(0, slots, k)
    expected_v.index_copy_(0, slots, v)
    torch.ops.spmd_cpu.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.spmd_cpu.write_kv(k[:1], v[:1], k_cache, v_cache, torch.tensor([256]))


needs_mkl_kernel = pytest.mark.skipif(
    not (cpu_attention.load() and torch.backends.mkl.is_available()),
    reason="the C++ prefill attention needs the library built and a torch with MKL")


def fused_qkv(tokens, heads, kv_heads, dim, dtype=torch.float32):
    """q, k, v of `dtype` as views of one fused QKV output, as the layer makes them."""
    torch.manual_seed(tokens * dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 2).to(dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    return q, k, v


def causal_sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
        enable_gqa=True).squeeze(0).transpose(0, 1)


PREFILL_TOKENS = [1, 5, 31, 33, 100, 300]
PREFILL_SHAPES = [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 2, 40)]


@needs_mkl_kernel
@pytest.mark.parametrize("tokens", PREFILL_TOKENS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), PREFILL_SHAPES)
def test_prefill_attention_equals_causal_sdpa(tokens, heads, kv_heads, dim) -> None:
    """float32: the C++ causal attention of a fresh prompt against SDPA with is_causal."""
    q, k, v = fused_qkv(tokens, heads, kv_heads, dim)
    got = torch.ops.spmd_cpu.prefill_attention(q, k, v, dim ** -0.5)
    assert got.shape == (tokens, heads, dim) and got.is_contiguous()
    # Sharp softmaxes (scores of std ~20-45): float32 rounding of sums taken in another order.
    torch.testing.assert_close(got, causal_sdpa(q, k, v, dim ** -0.5), rtol=1e-4, atol=1e-4)


def band_sdpa(q, k, v, scale, window):
    """SDPA under an explicit boolean band mask: query i sees keys i - window < j <= i."""
    i, j = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None, :]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=(j <= i) & (j > i - window), scale=scale,
        enable_gqa=True).squeeze(0).transpose(0, 1)


# 1: each query alone; 7: within a 32-query block; 32: a block; 45: across blocks, unaligned;
# 1000: past every prompt (plain causal).
PREFILL_WINDOWS = [1, 7, 32, 45, 1000]


@needs_mkl_kernel
@pytest.mark.parametrize("tokens", [1, 33, 100, 300])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), PREFILL_SHAPES)
@pytest.mark.parametrize("window", PREFILL_WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_prefill_attention_equals_sdpa_under_a_band_mask(tokens, heads, kv_heads, dim,
                                                                  window, dtype) -> None:
    """float32 to the causal test's tolerance; bfloat16 against the float32 attention of the
    widened values, to the bfloat16 bound below."""
    q, k, v = fused_qkv(tokens, heads, kv_heads, dim, dtype)
    got = torch.ops.spmd_cpu.prefill_attention(q, k, v, dim ** -0.5, window)
    assert got.dtype == dtype and got.shape == (tokens, heads, dim)
    expected = band_sdpa(q.float(), k.float(), v.float(), dim ** -0.5, window)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    else:
        assert_bf16_attention_close(got, expected, v)


@needs_mkl_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_window_of_zero_or_the_whole_prompt_is_plain_causal(dtype) -> None:
    q, k, v = fused_qkv(100, 9, 3, 64, dtype)
    causal = torch.ops.spmd_cpu.prefill_attention(q, k, v, 0.125)
    for window in (0, 100, 5000):
        assert torch.equal(torch.ops.spmd_cpu.prefill_attention(q, k, v, 0.125, window), causal)


@needs_mkl_kernel
@pytest.mark.parametrize("tokens", PREFILL_TOKENS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), PREFILL_SHAPES)
def test_bf16_prefill_attention_equals_float32_sdpa_of_the_widened_values(tokens, heads,
                                                                          kv_heads, dim) -> None:
    """bfloat16 q, k, v, float32 sums: the bfloat16 output is float32 SDPA of the same values
    widened, to the bfloat16 bound below."""
    q, k, v = fused_qkv(tokens, heads, kv_heads, dim, torch.bfloat16)
    got = torch.ops.spmd_cpu.prefill_attention(q, k, v, dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, heads, dim)
    expected = causal_sdpa(q.float(), k.float(), v.float(), dim ** -0.5)
    assert_bf16_attention_close(got, expected, v)


def assert_bf16_attention_close(got, expected, v) -> None:
    """bfloat16 attention (decode or prompt) against float32 attention of the widened values.
    The output is rounded once (2**-9 of itself), and on AVX512-BF16 builds the softmax weights
    are rounded to bfloat16 for the value sums: each weight off by at most 2**-9 of itself, so a
    row's sum by at most 2**-9 of the largest |v| it sees. Twice each, for the float32 sums' own
    rounding."""
    atol = 2 ** -8 * v.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -8, atol=atol)


# Bad arguments. Each case changes one thing in a valid set of arguments; every entry point must
# refuse it with a RuntimeError naming the argument, before it reads or writes anything.

def set_item(name, index, value):
    """A change: args[name][index] = value (on a copy)."""
    def change(args):
        tensor = args[name].clone()
        tensor[index] = value
        return {**args, name: tensor}
    return change


def replace(*names, make):
    """A change: each of args[names] replaced by make(it)."""
    return lambda args: {**args, **{name: make(args[name]) for name in names}}


def strided(t):
    """The same values and shape, not contiguous."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def decode_args():
    """Valid paged_decode_attention arguments, float32: 3 sequences (5, 12 and 1 tokens) over a
    cache of 10 blocks of 4 slots, tables 3 blocks wide ([0][2] is padding)."""
    torch.manual_seed(3)
    return {"q": torch.randn(3, 4, 16), "k_cache": torch.randn(40, 2, 16),
            "v_cache": torch.randn(40, 2, 16),
            "block_tables": torch.tensor([[3, 1, 9], [2, 0, 5], [7, 4, 4]], dtype=torch.int32),
            "lengths": torch.tensor([5, 12, 1], dtype=torch.int32), "block_size": 4,
            "scale": 0.25}


def with_starts(values, dtype=torch.int32):
    """A change: a window's starts added."""
    return lambda args: {**args, "starts": torch.tensor(values, dtype=dtype)}


def in_bf16(change):
    """The change applied to bfloat16 q and caches."""
    return lambda args: change(replace("q", "k_cache", "v_cache", make=torch.Tensor.bfloat16)(args))


DECODE_REFUSALS = [
    pytest.param(set_item("block_tables", (2, 0), 10),
                 r"block_tables\[2\]\[0\] = 10 is outside the cache's 10 blocks", id="past-cache"),
    pytest.param(in_bf16(set_item("block_tables", (1, 1), 40)),
                 r"block_tables\[1\]\[1\] = 40 is outside", id="past-cache-bf16"),
    pytest.param(set_item("block_tables", (1, 2), -1), r"block_tables\[1\]\[2\] = -1 is outside",
                 id="negative-entry"),
    pytest.param(set_item("lengths", 0, 13), r"lengths\[0\] = 13 is past block_tables' 3 blocks",
                 id="length-past-table"),
    pytest.param(set_item("lengths", 2, 0), r"lengths\[2\] = 0 must be >= 1", id="zero-length"),
    pytest.param(set_item("lengths", 1, -3), r"lengths\[1\] = -3 must be >= 1",
                 id="negative-length"),
    pytest.param(replace("block_tables", make=lambda t: t[:2]),
                 "block_tables has 2 rows but q has 3", id="table-rows"),
    pytest.param(replace("lengths", make=lambda t: t[:2]), "lengths has 2 entries but q has 3",
                 id="length-rows"),
    pytest.param(replace("q", make=lambda t: t[:2]), "block_tables has 3 rows but q has 2",
                 id="q-rows"),
    pytest.param(replace("q", make=lambda t: t[..., :8]),
                 "q's head_dim 8 differs from k_cache's 16", id="head-size"),
    pytest.param(replace("q", make=lambda t: t[:, :3]),
                 "q's 3 heads are not a multiple of k_cache's 2 KV heads", id="heads"),
    pytest.param(replace("v_cache", make=lambda t: t[:, :1].contiguous()),
                 r"v_cache \[40, 1, 16\] and k_cache \[40, 2, 16\]", id="cache-shapes"),
    pytest.param(replace("block_size", make=lambda _: 0), "block_size 0 must be >= 1",
                 id="zero-block-size"),
    pytest.param(replace("block_size", make=lambda _: 3), "block_size 3 .* k_cache's 40 slots",
                 id="block-size-not-dividing"),
    pytest.param(replace("q", make=lambda t: t[0]), "q must be 3-D", id="q-rank"),
    pytest.param(replace("block_tables", make=lambda t: t[0]), "block_tables must be 2-D",
                 id="table-rank"),
    pytest.param(replace("q", "k_cache", "v_cache", make=torch.Tensor.double),
                 "q must be float32 or bfloat16", id="float64"),
    pytest.param(replace("k_cache", make=torch.Tensor.bfloat16),
                 "k_cache is BFloat16 but q is Float", id="k-cache-dtype"),
    pytest.param(replace("v_cache", make=torch.Tensor.bfloat16),
                 "v_cache is BFloat16 but q is Float", id="v-cache-dtype"),
    pytest.param(replace("q", make=torch.Tensor.bfloat16), "k_cache is Float but q is BFloat16",
                 id="q-dtype"),
    pytest.param(replace("lengths", make=torch.Tensor.long), "lengths must be contiguous int32",
                 id="length-dtype"),
    pytest.param(replace("block_tables", make=torch.Tensor.float),
                 "block_tables must be int32 or int64", id="table-dtype"),
    pytest.param(replace("k_cache", make=strided), "k_cache and v_cache must be contiguous",
                 id="strided-cache"),
    pytest.param(with_starts([0, 4, 0], torch.int64), "starts must be contiguous int32",
                 id="starts-dtype"),
    pytest.param(with_starts([0, 4]), "starts has 2 entries but lengths has 3",
                 id="starts-length"),
    pytest.param(with_starts([[0, 4, 0]]), "starts must be 1-D", id="starts-rank"),
    pytest.param(lambda args: {**args, "starts": torch.zeros(6, dtype=torch.int32)[::2]},
                 "starts must be contiguous int32", id="starts-strided"),
    pytest.param(with_starts([5, 4, 0]), r"starts\[0\] = 5 is outside \[0, lengths\[0\] = 5\)",
                 id="start-at-length"),
    pytest.param(with_starts([0, 13, 0]), r"starts\[1\] = 13 is outside", id="start-past-length"),
    pytest.param(with_starts([0, 4, -1]), r"starts\[2\] = -1 is outside", id="negative-start"),
    pytest.param(in_bf16(with_starts([0, 4, 1])), r"starts\[2\] = 1 is outside",
                 id="start-past-length-bf16"),
    # Entries from the start's block on are still checked.
    pytest.param(lambda args: with_starts([0, 4, 0])(set_item("block_tables", (1, 1), 10)(args)),
                 r"block_tables\[1\]\[1\] = 10 is outside", id="entry-in-window"),
]


@needs_kernel
@pytest.mark.parametrize(("change", "match"), DECODE_REFUSALS)
def test_decode_attention_refuses_bad_arguments_naming_them(change, match) -> None:
    """float32 arguments (bfloat16 where the case id says so) with one thing wrong."""
    args = decode_args()
    cpu_attention.paged_decode_attention(**args)          # valid as made
    with pytest.raises(RuntimeError, match=match):
        cpu_attention.paged_decode_attention(**change(args))


def write_args():
    """Valid write_kv arguments, float32: 4 tokens' rows into caches of 40 slots."""
    torch.manual_seed(4)
    return {"k": torch.randn(4, 2, 16), "v": torch.randn(4, 2, 16),
            "k_cache": torch.zeros(40, 2, 16), "v_cache": torch.zeros(40, 2, 16),
            "slots": torch.tensor([0, 5, 39, 7])}


WRITE_REFUSALS = [
    pytest.param(set_item("slots", 1, -1), r"slots\[1\] = -1 is out of range for the caches' 40",
                 id="negative-slot"),
    pytest.param(set_item("slots", 2, 40), r"slots\[2\] = 40 is out of range", id="slot-past-end"),
    pytest.param(replace("slots", make=lambda t: t[:3]), "slots has 3 entries but k has 4 tokens",
                 id="slot-count"),
    pytest.param(replace("slots", make=torch.Tensor.int), "slots must be int64", id="slot-dtype"),
    pytest.param(replace("slots", make=lambda t: t[None]), "slots must be 1-D", id="slot-rank"),
    pytest.param(replace("v", make=lambda t: t[..., :8]), r"v \[4, 2, 8\] and k \[4, 2, 16\]",
                 id="k-v-shapes"),
    pytest.param(replace("k", "v", make=lambda t: t[..., :8]),
                 "k's rows of 2 x 8 elements differ from k_cache's rows of 2 x 16", id="row-size"),
    pytest.param(replace("v_cache", make=lambda t: t[:20]),
                 r"v_cache \[20, 2, 16\] and k_cache \[40, 2, 16\]", id="cache-shapes"),
    pytest.param(replace("k", "v", make=torch.Tensor.bfloat16),
                 "k_cache is Float but k is BFloat16", id="bf16-rows-float32-caches"),
    pytest.param(replace("v", make=torch.Tensor.bfloat16), "v is BFloat16 but k is Float",
                 id="v-dtype"),
    pytest.param(replace("v_cache", make=torch.Tensor.bfloat16),
                 "v_cache is BFloat16 but k is Float", id="v-cache-dtype"),
    pytest.param(replace("k", "v", "k_cache", "v_cache", make=torch.Tensor.double),
                 "k must be float32 or bfloat16", id="float64"),
    pytest.param(replace("k_cache", make=strided), "k_cache and v_cache must be contiguous",
                 id="strided-cache"),
]


@needs_kernel
@pytest.mark.parametrize(("change", "match"), WRITE_REFUSALS)
def test_write_kv_refuses_bad_arguments_naming_them_and_writes_nothing(change, match) -> None:
    """float32 arguments (bfloat16 where the case id says so) with one thing wrong: refused,
    and neither cache touched (every slot is checked before the first copy)."""
    args = change(write_args())
    k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.spmd_cpu.write_kv(**args)
    assert torch.equal(args["k_cache"], k_before) and torch.equal(args["v_cache"], v_before)


def prefill_args():
    """Valid prefill_attention arguments, float32: 8 tokens, 4 heads over 2 KV heads."""
    torch.manual_seed(5)
    return {"q": torch.randn(8, 4, 16), "k": torch.randn(8, 2, 16), "v": torch.randn(8, 2, 16),
            "scale": 0.25}


PREFILL_REFUSALS = [
    pytest.param(replace("q", make=lambda t: t[0]), "q must be 3-D", id="q-rank"),
    pytest.param(replace("k", "v", make=lambda t: t[:7]), "k has 7 tokens but q has 8",
                 id="token-count"),
    pytest.param(replace("k", "v", make=lambda t: t[..., :8]),
                 "k's head_dim 8 differs from q's 16", id="head-size"),
    pytest.param(replace("q", make=lambda t: t[:, :3]),
                 "q's 3 heads are not a multiple of k's 2 KV heads", id="heads"),
    pytest.param(replace("v", make=lambda t: t[:, :1]), r"v \[8, 1, 16\] and k \[8, 2, 16\]",
                 id="k-v-shapes"),
    pytest.param(replace("k", make=torch.Tensor.bfloat16), "k is BFloat16 but q is Float",
                 id="k-dtype"),
    pytest.param(replace("q", "k", "v", make=torch.Tensor.double),
                 "q must be float32 or bfloat16", id="float64"),
    pytest.param(replace("q", make=lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
                 "q's heads of each position must lie side by side", id="heads-apart"),
    pytest.param(lambda args: {**args, "window": -1}, "window -1 must be >= 0",
                 id="negative-window"),
]


@needs_mkl_kernel
@pytest.mark.parametrize(("change", "match"), PREFILL_REFUSALS)
def test_prefill_attention_refuses_bad_arguments_naming_them(change, match) -> None:
    """float32 arguments (bfloat16 where the case id says so) with one thing wrong."""
    args = prefill_args()
    torch.ops.spmd_cpu.prefill_attention(**args)          # valid as made
    with pytest.raises(RuntimeError, match=match):
        torch.ops.spmd_cpu.prefill_attention(**change(args))
