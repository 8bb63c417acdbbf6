"""The fused element-wise passes of a float32 CPU layer (runtime/layers/cpu_layers.cpp, used by
runtime/models/llama.py FUSED_CPU) against the torch chains they replace."""
from __future__ import annotations

import pytest
import torch
from spmd_runtime.runtime.layers import cpu_ops
from spmd_runtime.runtime.layers.rotary import RotaryEmbedding
from spmd_runtime.runtime.models.llama import (
    EAGER,
    FUSED_CPU,
    attention_inputs,
    eager_pieces,
    fused_attention_inputs,
    fused_mlp_inputs,
    mlp_inputs,
)

needs_ops = pytest.mark.skipif(not cpu_ops.load(), reason="the C++ operators cannot be built here")


@needs_ops
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128)])
def test_fused_pieces_equal_the_torch_chains(tokens, heads, kv_heads, head_dim) -> None:
    torch.manual_seed(tokens)
    hidden = 96
    x = torch.randn(tokens, hidden)
    norm = torch.rand(hidden) + 0.5
    qkv_weight = torch.randn((heads + 2 * kv_heads) * head_dim, hidden) * 0.1
    qkv_bias = torch.randn(qkv_weight.shape[0])
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.float32)
    cos, sin = rotary.tables(torch.randint(0, 4096, (tokens,)))
    for bias in (None, qkv_bias):
        expected = attention_inputs(x, norm, 1e-5, qkv_weight, bias, cos, sin, heads, kv_heads,
                                    head_dim)
        got = fused_attention_inputs(x, norm, 1e-5, qkv_weight, bias, cos, sin, heads, kv_heads,
                                     head_dim)
        for e, g in zip(expected, got, strict=True):
            assert g.shape == e.shape
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    attention_output = torch.randn(tokens, hidden)
    gate_up = torch.randn(2 * 80, hidden) * 0.1
    expected = mlp_inputs(x, attention_output, norm, 1e-6, gate_up, 80)
    got = fused_mlp_inputs(x, attention_output, norm, 1e-6, gate_up, 80)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@needs_ops
def test_fused_norm_reads_row_strided_inputs_and_refuses_other_dtypes() -> None:
    wide = torch.randn(6, 50)
    x = wide[:, :32]
    weight = torch.rand(32)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(torch.ops.spmd_cpu.rms_norm(x, weight, 1e-5), expected)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.spmd_cpu.rms_norm(x.double(), weight, 1e-5)


def test_eager_pieces_fuse_only_float32_on_the_cpu() -> None:
    assert eager_pieces(torch.device("cpu"), torch.bfloat16) is EAGER
    assert eager_pieces(torch.device("cuda"), torch.float32) is EAGER
    expected = FUSED_CPU if cpu_ops.load() else EAGER
    assert eager_pieces(torch.device("cpu"), torch.float32) is expected


@needs_ops
@pytest.mark.parametrize("features", [1, 7, 37, 64, 200])
def test_silu_mul_matches_torch_across_widths_and_extremes(features) -> None:
    """Every width (vector body and scalar tail), and gates where exp under- or overflows."""
    torch.manual_seed(features)
    gate_up = torch.randn(5, 2 * features) * 6
    gate_up[0, :min(features, 6)] = torch.tensor([-200.0, -88.0, -1e-3, 0.0, 88.0, 200.0])[
        :min(features, 6)]
    gate, up = gate_up.split(features, dim=-1)
    torch.testing.assert_close(torch.ops.spmd_cpu.silu_mul(gate_up),
                               torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
