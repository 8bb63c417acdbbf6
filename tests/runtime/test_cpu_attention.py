"""The C++ decode-attention kernel (runtime/layers/cpu_attention.cpp) and the causal prefill
attention (cpu_prefill_attention.cpp) against SDPA, and how a worker picks them. The
runner-level check (its tokens equal the torch path's, eager and through emulated bucket
graphs) is in tests/worker_proc/test_graphs.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime.layers import cpu_attention
from spmd_runtime.worker_proc.worker import use_decode_kernel

needs_kernel = pytest.mark.skipif(not cpu_attention.load(),
                                  reason="the C++ kernel cannot be built here (no compiler?)")


def reference(q, k_cache, v_cache, tables, lengths, block_size, scale):
    out = torch.empty_like(q)
    for i, length in enumerate(lengths.tolist()):
        slots = torch.tensor([int(tables[i, t // block_size]) * block_size + t % block_size
                              for t in range(length)])
        out[i] = F.scaled_dot_product_attention(
            q[i][:, None], k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1),
            scale=scale, enable_gqa=True)[:, 0]
    return out


@needs_kernel
@pytest.mark.parametrize("block_size,heads,kv_heads,dim", [(4, 4, 2, 16), (16, 9, 3, 64),
                                                           (16, 32, 8, 64), (8, 8, 8, 32),
                                                           (16, 4, 1, 80)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_equals_sdpa_over_the_gathered_context(block_size, heads, kv_heads, dim,
                                                      index_dtype) -> None:
    """1-token contexts, partial last blocks, many blocks, blocks out of order, and table
    entries past the context (padding) that must not be read into the result."""
    torch.manual_seed(0)
    num_blocks = 40
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
    lengths = torch.tensor([1, 7, block_size, 33, 70, 130], dtype=torch.int32)
    width = -(-int(lengths.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lengths]).to(index_dtype)
    q = torch.randn(len(lengths), heads, dim)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, block_size,
                                               dim ** -0.5)
    expected = reference(q, k_cache, v_cache, tables, lengths, block_size, dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_reads_strided_queries_and_refuses_what_it_cannot_run() -> None:
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    lengths = torch.tensor([5, 8], dtype=torch.int32)
    wide = torch.randn(2, 4, 32)
    q = wide[..., :16]                          # a view with a row stride, as after a split
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 4, 0.25)
    torch.testing.assert_close(out, reference(q.contiguous(), k_cache, v_cache, tables, lengths,
                                              4, 0.25), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_attention.paged_decode_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(),
                                             tables, lengths, 4, 0.25)


def test_a_cpu_worker_picks_the_kernel_where_it_builds_and_a_bad_request_says_what_to_change(
        ) -> None:
    cpu = torch.device("cpu")
    built = cpu_attention.load()
    assert use_decode_kernel(EngineConfig(), cpu, 64) == ("cpp" if built else "")
    assert use_decode_kernel(EngineConfig(attention_backend="torch"), cpu, 64) == ""
    # Not float32: the torch path on auto; an explicit request says what to change.
    assert use_decode_kernel(EngineConfig(), cpu, 64, torch.bfloat16) == ""
    with pytest.raises(ValueError, match="use --attention-backend torch or auto"):
        use_decode_kernel(EngineConfig(attention_backend="cpp"), cpu, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="use --attention-backend torch or auto"):
        use_decode_kernel(EngineConfig(attention_backend="cpp"), torch.device("cuda"), 64)


@needs_kernel
def test_write_kv_makes_the_copies_index_copy_makes_and_refuses_bad_slots() -> None:
    torch.manual_seed(2)
    k_cache, v_cache = torch.randn(256, 3, 16), torch.randn(256, 3, 16)
    qkv = torch.randn(40, 9 * 16)                 # k and v as strided views of a fused output
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


@needs_mkl_kernel
@pytest.mark.parametrize("tokens", [1, 5, 31, 33, 100, 300])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 128),
                                                         (6, 2, 40)])
def test_prefill_attention_equals_causal_sdpa(tokens, heads, kv_heads, dim) -> None:
    """The C++ causal attention of a fresh prompt, on q/k/v views of one fused QKV output (as
    the layer makes them), against SDPA with is_causal."""
    torch.manual_seed(tokens * dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 2
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    scale = dim ** -0.5
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
        enable_gqa=True).squeeze(0).transpose(0, 1)
    got = torch.ops.spmd_cpu.prefill_attention(q, k, v, scale)
    assert got.shape == (tokens, heads, dim) and got.is_contiguous()
    # Sharp softmaxes (scores of std ~20-45): float32 rounding of sums taken in another order.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@needs_mkl_kernel
def test_prefill_attention_refuses_what_it_cannot_run() -> None:
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.spmd_cpu.prefill_attention(q.double(), k.double(), k.double(), 0.25)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.spmd_cpu.prefill_attention(torch.randn(8, 3, 16), k, k, 0.25)
    with pytest.raises(RuntimeError, match="side by side"):
        torch.ops.spmd_cpu.prefill_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, k,
                                             0.25)
