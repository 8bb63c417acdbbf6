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


def packed_tiny_model(layers: int = 3):
    from spmd_runtime.protocol.model_config import ModelConfig
    from spmd_runtime.runtime.layers import linear as linear_mod
    from spmd_runtime.runtime.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=200, hidden_size=128, intermediate_size=96,
                         num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_ids=(0,))
    model = LlamaForCausalLM(config, torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.2 if "norm" in name else 0.1
            parameter.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn_like(parameter))
    linear_mod.pack_linear_weights(model)
    return model, config


def decode_batch(config, sequences: int, block_size: int = 16):
    """Random KV caches and one decode per sequence at a random context length, as the model
    runner lays a C++-kernel step out: one group, int32 tables and lengths."""
    from spmd_runtime.runtime.layers.attention import AttentionBatch, DecodeGroup

    num_blocks = 4 * sequences
    caches = [(torch.randn(num_blocks * block_size, config.num_key_value_heads, config.head_dim),
               torch.randn(num_blocks * block_size, config.num_key_value_heads, config.head_dim))
              for _ in range(config.num_hidden_layers)]
    lengths = torch.randint(1, 60, (sequences,), dtype=torch.int32)
    per_sequence = -(-int(lengths.max()) // block_size)
    tables = torch.randperm(num_blocks)[:sequences * per_sequence].to(torch.int32)
    rows = tables.view(sequences, per_sequence).long()
    positions = (lengths - 1).long()
    slots = rows[torch.arange(sequences), positions // block_size] * block_size + \
        positions % block_size
    group = DecodeGroup(0, sequences, tables, None, lengths)
    batch = AttentionBatch(block_size=block_size, slot_mapping=slots, decodes=[group],
                           prefills=[], decode_kernel="cpp")
    return caches, batch, positions


@needs_ops
@pytest.mark.parametrize("sequences", [1, 7, 64])
def test_decode_layers_in_one_call_equal_the_layer_loop_to_the_bit(sequences) -> None:
    """spmd_cpu::decode_layers runs the layer loop's operators in its order: the same hidden
    states and the same cache contents, exactly."""
    model, config = packed_tiny_model()
    caches, batch, positions = decode_batch(config, sequences)
    ids = torch.randint(0, config.vocab_size, (sequences,))
    assert model.fused_decode_weights(batch, sequences) is not None
    loop_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.no_grad():
        fused = model(ids, positions, caches, batch, FUSED_CPU)
        x = model.embed_tokens[ids]
        rope = model.rotary.tables(positions)
        for layer, kv_cache in zip(model.layers, loop_caches, strict=True):
            x = layer(x, rope, kv_cache, batch, FUSED_CPU)
        expected = model.norm(x)
    assert torch.equal(fused, expected)
    for (k, v), (k_loop, v_loop) in zip(caches, loop_caches, strict=True):
        assert torch.equal(k, k_loop) and torch.equal(v, v_loop)


@needs_ops
def test_decode_layers_run_only_for_a_plain_decode_batch_of_packed_weights() -> None:
    from dataclasses import replace

    from spmd_runtime.runtime.layers.attention import PrefillChunk

    model, config = packed_tiny_model(layers=1)
    _, batch, _ = decode_batch(config, 4)
    assert model.fused_decode_weights(batch, 4) is not None
    assert model.fused_decode_weights(batch, 5) is None             # rows outside the group
    assert model.fused_decode_weights(replace(batch, decode_kernel=""), 4) is None
    assert model.fused_decode_weights(replace(batch, pad_start=3), 4) is None
    chunk = PrefillChunk(4, 3, None, None)
    assert model.fused_decode_weights(replace(batch, prefills=[chunk]), 7) is None
    plain_model, _ = packed_tiny_model(layers=1)
    plain_model.layers[0].mlp.down_proj = torch.nn.Parameter(torch.zeros(128, 96),
                                                             requires_grad=False)
    assert plain_model.fused_decode_weights(batch, 4) is None       # a weight left unpacked
