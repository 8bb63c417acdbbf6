"""The fused element-wise passes of a CPU layer (runtime/layers/cpu_layers.cpp, used by
runtime/models/llama.py FUSED_CPU) and the one-call decode step (cpu_decode_layers.cpp): in
float32 and bfloat16 against the torch chains they replace, and the arguments they refuse."""
from __future__ import annotations

import importlib

import pytest
import torch
from cpu_library import needs_bf16_tiles, needs_f32_panels, needs_int8_blocks
from cpu_library import needs_cpu_ops as needs_ops
from spmd_runtime.runtime.layers.attention_backend import CPP, TORCH
from spmd_runtime.runtime.layers.linear import linear as runtime_linear
from spmd_runtime.runtime.layers.rotary import RotaryEmbedding
from spmd_runtime.runtime.models import FAMILIES
from spmd_runtime.runtime.models.gemma2 import Gemma2ForCausalLM
from spmd_runtime.runtime.models.layer_pieces import (
    EAGER,
    FUSED_CPU,
    LAYER_PASSES,
    LAYER_STACK,
    LayerPieces,
    attention_inputs,
    eager_pieces,
    fused_attention_inputs,
    fused_cpu_paths_of,
    fused_mlp_inputs,
    mlp_inputs,
)
from spmd_runtime.runtime.models.llama import LlamaForCausalLM


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


def test_eager_pieces_fuse_where_the_attention_backend_has_the_fused_passes() -> None:
    assert eager_pieces(CPP) is FUSED_CPU
    assert eager_pieces(TORCH) is EAGER


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


def packed_tiny_model(layers: int = 3, dtype: torch.dtype = torch.float32):
    from spmd_runtime.runtime.layers import linear as linear_mod

    model, config = tiny_model(layers, dtype)
    linear_mod.pack_linear_weights(model)
    return model, config


def tiny_model(layers: int, dtype: torch.dtype):
    from spmd_runtime.protocol.model_config import ModelConfig
    from spmd_runtime.runtime.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=200, hidden_size=128, intermediate_size=96,
                         num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_ids=(0,))
    model = LlamaForCausalLM(config, dtype).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.2 if "norm" in name else 0.1
            parameter.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn_like(parameter))
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
                           prefills=[], backend=CPP)
    return caches, batch, positions


@needs_ops
@pytest.mark.parametrize("sequences", [1, 7, 64])
def test_decode_layers_in_one_call_equal_the_layer_loop_to_the_bit(sequences) -> None:
    """spmd_cpu::decode_layers runs the layer loop's operators in its order: the same hidden
    states and the same cache contents, exactly (float32, MKL-packed projections)."""
    assert_one_call_is_the_layer_loop(*packed_tiny_model(), sequences)


def assert_one_call_is_the_layer_loop(model, config, sequences: int) -> None:
    """The one-call decode and the layer loop on the same random caches (in the model's dtype):
    the same hidden states and cache contents, to the bit."""
    dtype = model.embed_tokens.dtype
    caches, batch, positions = decode_batch(config, sequences)
    caches = [(k.to(dtype), v.to(dtype)) for k, v in caches]
    ids = torch.randint(0, config.vocab_size, (sequences,))
    assert model.fused_decode_weights(batch, sequences) is not None
    assert_forward_is_the_layer_loop(model, ids, positions, caches, batch)


def assert_forward_is_the_layer_loop(model, ids, positions, caches, batch) -> None:
    """The model's FUSED_CPU forward on `caches` against each layer through the loop on copies
    of them: the same hidden states (in the model's dtype) and cache contents, to the bit."""
    dtype = model.embed_tokens.dtype
    loop_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.no_grad():
        fused = model(ids, positions, caches, batch, FUSED_CPU)
        x = model.embed_tokens[ids]
        rope = model.rotary.tables(positions)
        for layer, kv_cache in zip(model.layers, loop_caches, strict=True):
            x = layer(x, rope, kv_cache, batch, FUSED_CPU)
        expected = model.norm(x)
    assert fused.dtype == dtype and torch.equal(fused, expected)
    for (k, v), (k_loop, v_loop) in zip(caches, loop_caches, strict=True):
        assert torch.equal(k, k_loop) and torch.equal(v, v_loop)


BF16_PACKING = importlib.import_module("spmd_runtime.runtime.layers.linear").can_pack(
    torch.device("cpu"), torch.bfloat16)


@needs_ops
@pytest.mark.parametrize("packed", [
    pytest.param(True, marks=pytest.mark.skipif(not BF16_PACKING, reason="oneDNN computes no "
                                                "bfloat16 on this CPU (no AVX-512)")), False])
def test_bf16_decode_layers_in_one_call_equal_the_layer_loop_to_the_bit(packed) -> None:
    """bfloat16 (assertions on bf16 hidden states and caches): the one-call decode over
    oneDNN-packed projections, or plain ones, gives the layer loop's bits."""
    model, config = packed_tiny_model(dtype=torch.bfloat16) if packed else \
        tiny_model(3, torch.bfloat16)
    assert isinstance(model.layers[0].mlp.gate_up_proj, torch.Tensor) != packed
    assert_one_call_is_the_layer_loop(model, config, 7)


def gguf_tiny_model(tensor_type, dtype=torch.bfloat16):
    """tiny_model in `dtype` with every projection held as `tensor_type`'s GGUF blocks."""
    import gguf
    import numpy as np
    from spmd_runtime.runtime.layers.group_quant import from_gguf_blocks
    from spmd_runtime.runtime.layers.quantization import swap_weight

    model, config = tiny_model(3, dtype)
    for module, name in model.projection_slots():
        weight = getattr(module, name).float().numpy()
        raw = gguf.quants.quantize(np.ascontiguousarray(weight), tensor_type)
        swap_weight(module, name, from_gguf_blocks(raw, tensor_type, weight.shape, dtype))
    return model, config


@needs_bf16_tiles
@pytest.mark.parametrize("sequences", [7, 20])
@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q8_0"])
def test_gguf_decode_layers_in_one_call_equal_the_layer_loop_to_the_bit(tensor_type,
                                                                         sequences) -> None:
    """bfloat16 (assertions on bf16 hidden states and caches): projections kept in GGUF blocks
    (--quantization gguf) run in the one-call decode through gguf_bf16_linear, as the layer
    loop multiplies them: the same bits at 7 rows (8-feature panels) and 20 (packed panels);
    a lone row stays in the layer loop, whose products are integer."""
    from gguf import GGMLQuantizationType as GGML

    model, config = gguf_tiny_model(GGML[tensor_type])
    assert_one_call_is_the_layer_loop(model, config, sequences)
    _, batch, _ = decode_batch(config, 1)
    assert model.fused_decode_weights(batch, 1) is None


@needs_f32_panels
@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q8_0"])
def test_float32_gguf_decode_layers_in_one_call_equal_the_layer_loop_to_the_bit(tensor_type) -> None:
    """float32 (assertions on float32 hidden states and caches): GGUF blocks run in the one-call
    decode through gguf_linear's float32 panels past their integer rows (20 rows: in the
    lanes), as the layer loop multiplies them; 8 rows stay in the layer loop, whose products
    are integer there."""
    from gguf import GGMLQuantizationType as GGML

    model, config = gguf_tiny_model(GGML[tensor_type], torch.float32)
    assert_one_call_is_the_layer_loop(model, config, 20)
    _, batch, _ = decode_batch(config, 8)
    assert model.fused_decode_weights(batch, 8) is None


@needs_int8_blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sequences", [24, 64])
def test_int8_gguf_decode_layers_in_one_call_equal_the_layer_loop_to_the_bit(dtype,
                                                                             sequences) -> None:
    """bfloat16 and float32 (assertions on hidden states and caches in that dtype):
    --quantization int8 over GGUF blocks runs the one-call decode through gguf_int8_linear at
    its row counts (24: the plain gate/up product and silu_mul; 64: SiLU x up in the product),
    as the layer loop multiplies them."""
    from gguf import GGMLQuantizationType as GGML
    from spmd_runtime.runtime.layers.int8_blocks import takes_int8
    from spmd_runtime.runtime.layers.quantization import quantize_linear_weights

    model, config = gguf_tiny_model(GGML.Q4_1, dtype)
    quantize_linear_weights(model, "int8")
    assert takes_int8(model.layers[0].mlp.down_proj, sequences)
    assert_one_call_is_the_layer_loop(model, config, sequences)


@needs_bf16_tiles
def test_gguf_decode_layers_refuse_a_bad_block_type_slot_naming_it() -> None:
    from gguf import GGMLQuantizationType as GGML

    model, config = gguf_tiny_model(GGML.Q8_0)
    caches, batch, positions = decode_batch(config, 7)
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in caches]
    weights = model.fused_decode_weights(batch, 7)
    x = model.embed_tokens[torch.randint(0, config.vocab_size, (7,))]
    rope = model.rotary.tables(positions)
    for stand_in, match in [(torch.zeros(2), r"weights\[2\] \(layer 0 QKV stand-in\) is a Float"),
                            (torch.tensor([int(GGML.Q8_0), 64]),
                             r"weights\[1\] .* blocks of a \[640, 64\] weight, \[640, 128\] expected")]:
        bad = list(weights)
        bad[2] = stand_in
        with pytest.raises(RuntimeError, match=match):
            model._fused_decode(x, rope, caches, batch, bad)


@needs_ops
def test_decode_layers_run_only_for_a_plain_decode_batch_of_packed_weights() -> None:
    from dataclasses import replace

    from spmd_runtime.runtime.layers.attention import PrefillChunk

    model, config = packed_tiny_model(layers=1)
    _, batch, _ = decode_batch(config, 4)
    assert model.fused_decode_weights(batch, 4) is not None
    assert model.fused_decode_weights(batch, 5) is None             # rows outside the group
    assert model.fused_decode_weights(replace(batch, backend=TORCH), 4) is None
    assert model.fused_decode_weights(replace(batch, pad_start=3), 4) is None
    chunk = PrefillChunk(4, 3, None, None)
    assert model.fused_decode_weights(replace(batch, prefills=[chunk]), 7) is None
    plain_model, _ = packed_tiny_model(layers=1)
    plain_model.layers[0].mlp.down_proj = torch.nn.Parameter(torch.zeros(128, 96),
                                                             requires_grad=False)
    assert plain_model.fused_decode_weights(batch, 4) is None       # a weight left unpacked


@needs_ops
def test_decode_layer_weights_are_built_once_a_row_count_and_again_after_a_swap() -> None:
    from spmd_runtime.runtime.layers.quantization import swap_weight

    model, config = packed_tiny_model(layers=2)
    _, batch, _ = decode_batch(config, 4)
    first = model.fused_decode_weights(batch, 4)
    assert first is not None and model.fused_decode_weights(batch, 4) is first
    attn = model.layers[0].self_attn
    packed = attn.qkv_proj
    swap_weight(attn, "qkv_proj", torch.zeros(packed.stand_in.shape))
    assert model.fused_decode_weights(batch, 4) is None             # the swapped weight seen
    swap_weight(attn, "qkv_proj", packed)
    again = model.fused_decode_weights(batch, 4)
    assert again is not first and len(again) == len(first)
    assert all(a is b for a, b in zip(again, first, strict=True))


# ---- Refused arguments: every one a Python RuntimeError naming the operator and the argument.

def _spmd():
    return torch.ops.spmd_cpu


def _layer_args() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"x": torch.randn(4, 32), "residual": torch.randn(4, 32), "weight": torch.rand(32),
            "qkv": torch.randn(4, 3 * 16), "cos": torch.randn(4, 16), "sin": torch.randn(4, 16),
            "gate_up": torch.randn(4, 20)}


# id -> (the call on _layer_args() with one argument spoiled, the message it must raise)
BAD_LAYER_CALLS = {
    "rms_norm x rank": (lambda a: _spmd().rms_norm(a["x"][0], a["weight"], 1e-5), "rms_norm: x "),
    "rms_norm x dtype": (lambda a: _spmd().rms_norm(a["x"].double(), a["weight"], 1e-5),
                         "rms_norm: x is Double"),
    "rms_norm x column stride": (lambda a: _spmd().rms_norm(a["x"].t(), torch.rand(4), 1e-5),
                                 "rms_norm: x has column stride"),
    "rms_norm weight length": (lambda a: _spmd().rms_norm(a["x"], a["weight"][:31], 1e-5),
                               "rms_norm: weight has shape"),
    "rms_norm weight rank": (lambda a: _spmd().rms_norm(a["x"], a["weight"][None], 1e-5),
                             "rms_norm: weight has shape"),
    "rms_norm weight dtype": (lambda a: _spmd().rms_norm(a["x"], a["weight"].bfloat16(), 1e-5),
                              "rms_norm: weight is BFloat16"),
    "add_rms_norm x dtype": (lambda a: _spmd().add_rms_norm(a["x"].half(), a["residual"].half(),
                                                            a["weight"], 1e-5),
                             "add_rms_norm: x is Half"),
    "add_rms_norm residual shape": (lambda a: _spmd().add_rms_norm(a["x"], a["residual"][:3],
                                                                   a["weight"], 1e-5),
                                    "add_rms_norm: .* residual"),
    "add_rms_norm residual rank": (lambda a: _spmd().add_rms_norm(a["x"], a["residual"][0],
                                                                  a["weight"], 1e-5),
                                   "add_rms_norm: residual"),
    "add_rms_norm residual dtype": (lambda a: _spmd().add_rms_norm(
        a["x"], a["residual"].bfloat16(), a["weight"], 1e-5), "add_rms_norm: residual"),
    "add_rms_norm weight length": (lambda a: _spmd().add_rms_norm(a["x"], a["residual"],
                                                                  a["weight"][:8], 1e-5),
                                   "add_rms_norm: weight"),
    "rotary_ qkv rank": (lambda a: _spmd().rotary_(a["qkv"].view(4, 3, 16), 2, 16, a["cos"],
                                                   a["sin"]), "rotary_: qkv"),
    "rotary_ qkv dtype": (lambda a: _spmd().rotary_(a["qkv"].double(), 2, 16, a["cos"], a["sin"]),
                          "rotary_: qkv is Double"),
    "rotary_ qkv overlapping rows": (lambda a: _spmd().rotary_(a["qkv"][:1].expand(4, -1), 2, 16,
                                                               a["cos"], a["sin"]),
                                     "rotary_: qkv rows overlap"),
    "rotary_ too many heads": (lambda a: _spmd().rotary_(a["qkv"], 4, 16, a["cos"], a["sin"]),
                               "rotary_: 4 rotated_heads"),
    "rotary_ negative heads": (lambda a: _spmd().rotary_(a["qkv"], -1, 16, a["cos"], a["sin"]),
                               "rotary_: -1 rotated_heads"),
    "rotary_ odd head_dim": (lambda a: _spmd().rotary_(a["qkv"], 1, 15, a["cos"][:, :15],
                                                       a["sin"][:, :15]), "rotary_: head_dim"),
    "rotary_ zero head_dim": (lambda a: _spmd().rotary_(a["qkv"], 1, 0, a["cos"], a["sin"]),
                              "rotary_: head_dim"),
    "rotary_ cos rows": (lambda a: _spmd().rotary_(a["qkv"], 2, 16, a["cos"][:3], a["sin"]),
                         "rotary_: cos has 3 rows, qkv has 4"),
    "rotary_ sin rows": (lambda a: _spmd().rotary_(a["qkv"], 2, 16, a["cos"], a["sin"][:3]),
                         "rotary_: sin has 3 rows"),
    "rotary_ cos half width": (lambda a: _spmd().rotary_(a["qkv"], 2, 16, a["cos"][:, :8],
                                                         a["sin"]), "rotary_: cos has 8 columns"),
    "rotary_ sin rank": (lambda a: _spmd().rotary_(a["qkv"], 2, 16, a["cos"], a["sin"][0]),
                         "rotary_: sin"),
    "rotary_ cos column stride": (lambda a: _spmd().rotary_(a["qkv"], 2, 16,
                                                            torch.randn(16, 4).t(), a["sin"]),
                                  "rotary_: cos has column stride"),
    "rotary_ bf16 tables for float32 qkv": (lambda a: _spmd().rotary_(
        a["qkv"], 2, 16, a["cos"].bfloat16(), a["sin"].bfloat16()), "rotary_: cos is BFloat16"),
    "rotary_ cos and sin dtypes differ": (lambda a: _spmd().rotary_(
        a["qkv"].bfloat16(), 2, 16, a["cos"], a["sin"].bfloat16()), "rotary_: sin is BFloat16"),
    "silu_mul odd width": (lambda a: _spmd().silu_mul(a["gate_up"][:, :19]),
                           "silu_mul: gate_up has 19 columns"),
    "silu_mul rank": (lambda a: _spmd().silu_mul(a["gate_up"][0]), "silu_mul: gate_up"),
    "silu_mul dtype": (lambda a: _spmd().silu_mul(a["gate_up"].double()),
                       "silu_mul: gate_up is Double"),
}


@needs_ops
@pytest.mark.parametrize("case", list(BAD_LAYER_CALLS))
def test_layer_ops_refuse_bad_arguments_naming_them(case) -> None:
    call, message = BAD_LAYER_CALLS[case]
    args = _layer_args()
    before = {name: t.clone() for name, t in args.items()}
    with pytest.raises(RuntimeError, match=message):
        call(args)
    assert all(torch.equal(args[name], t) for name, t in before.items())   # nothing written


def _plain_decode_weights(model) -> list[torch.Tensor]:
    """decode_layers' weights for an unpacked (bf16) model: each [out, in] projection in its
    packed slot and again in its stand-in slot, which the bf16 path ignores."""
    weights = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [layer.input_layernorm.weight, attn.qkv_proj, attn.qkv_proj, attn.o_proj,
                    attn.o_proj, layer.post_attention_layernorm.weight, mlp.gate_up_proj,
                    mlp.gate_up_proj, mlp.down_proj, mlp.down_proj]
    return weights


def _decode_args(layers: int = 2, sequences: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """decode_layers' arguments for a float32 model with packed projections or a bf16 model
    with plain ones, by name, in the schema's order."""
    model, config = packed_tiny_model(layers) if dtype == torch.float32 else \
        tiny_model(layers, dtype)
    caches, batch, positions = decode_batch(config, sequences)
    attn, group = model.layers[0].self_attn, batch.decodes[0]
    cos, sin = model.rotary.tables(positions)
    weights = model.fused_decode_weights(batch, sequences) if dtype == torch.float32 else \
        _plain_decode_weights(model)
    return {"x": model.embed_tokens[torch.randint(0, config.vocab_size, (sequences,))],
            "weights": weights, "k_caches": [k.to(dtype) for k, _ in caches],
            "v_caches": [v.to(dtype) for _, v in caches],
            "cos": cos.view(sequences, -1), "sin": sin.view(sequences, -1),
            "slots": batch.slot_mapping, "block_tables": group.blocks.view(sequences, -1),
            "lengths": group.lengths, "block_size": batch.block_size, "scale": attn.scale,
            "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
            "head_dim": attn.head_dim, "eps": 1e-5}


def _with_weight(index: int, tensor_of):
    """A spoiler replacing weights[index] by tensor_of(the arguments)."""
    def spoil(a):
        a["weights"] = [tensor_of(a) if i == index else w for i, w in enumerate(a["weights"])]
    return spoil


def _set(name, value_of):
    def spoil(a):
        a[name] = value_of(a)
    return spoil


# id -> (what spoils _decode_args(), the message decode_layers must raise)
BAD_DECODE_ARGS = {
    "weights not a multiple of 10": (_set("weights", lambda a: a["weights"][:-1]),
                                     "decode_layers: weights has 19 tensors"),
    "weights for fewer layers": (_set("weights", lambda a: a["weights"][:10]),
                                 "decode_layers: weights holds 1 layers and k_caches 2"),
    "v_caches count": (_set("v_caches", lambda a: a["v_caches"][:1]),
                       "decode_layers: 2 k_caches and 1 v_caches"),
    "x rank": (_set("x", lambda a: a["x"][0]), "decode_layers: x has shape"),
    "x not contiguous": (_set("x", lambda a: torch.randn(128, 3).t()), "decode_layers: x has"),
    "x dtype": (_set("x", lambda a: a["x"].double()), "decode_layers: x is Double"),
    "slots rows": (_set("slots", lambda a: a["slots"][:2]), "decode_layers: slots has 2 rows"),
    "lengths rows": (_set("lengths", lambda a: a["lengths"][:2]), "decode_layers: lengths"),
    "block_tables rows": (_set("block_tables", lambda a: a["block_tables"][:2]),
                          "decode_layers: block_tables has 2 rows"),
    "block_tables rank": (_set("block_tables", lambda a: a["block_tables"][0]),
                          "decode_layers: block_tables has 1 dimensions"),
    "cos rows": (_set("cos", lambda a: a["cos"][:1]), "decode_layers: cos has 1 rows"),
    "block_size zero": (_set("block_size", lambda a: 0), "decode_layers: block_size is 0"),
    "num_heads negative": (_set("num_heads", lambda a: -6), "decode_layers: num_heads is -6"),
    "num_kv_heads zero": (_set("num_kv_heads", lambda a: 0), "decode_layers: num_kv_heads is 0"),
    "head_dim zero": (_set("head_dim", lambda a: 0), "decode_layers: head_dim is 0"),
    "head_dim odd": (_set("head_dim", lambda a: 63), "decode_layers: head_dim is 63"),
    "heads not a multiple of kv_heads": (_set("num_heads", lambda a: 5),
                                         "decode_layers: num_heads 5 is not a multiple"),
    "k cache head_dim": (_set("k_caches", lambda a: [a["k_caches"][0], a["k_caches"][1][..., :32]]),
                         r"decode_layers: k_caches\[1\] has shape"),
    "v cache heads": (_set("v_caches", lambda a: [a["v_caches"][0][:, :1], a["v_caches"][1]]),
                      r"decode_layers: v_caches\[0\] has shape"),
    "input norm length": (_with_weight(0, lambda a: torch.ones(127)),
                          r"decode_layers: weights\[0\] \(layer 0 input norm\)"),
    "norm dtype": (_with_weight(15, lambda a: torch.ones(128, dtype=torch.bfloat16)),
                   r"decode_layers: weights\[15\] \(layer 1 post-attention norm\)"),
    "norm is a packed tensor": (_with_weight(5, lambda a: a["weights"][1]),
                                r"decode_layers: weights\[5\] .* a strided CPU tensor expected"),
    "qkv stand-in shape": (_with_weight(12, lambda a: torch.zeros(1, 1).expand(639, 128)),
                           r"decode_layers: weights\[12\] \(layer 1 QKV stand-in\)"),
    "plain weight in a packed slot": (_with_weight(3, lambda a: torch.zeros(128, 384)),
                                      r"decode_layers: weights\[3\] \(layer 0 output packed\)"),
    "packed slot too small": (_with_weight(18, lambda a: torch.zeros(8, 1).to_mkldnn()),
                              r"decode_layers: weights\[18\] \(layer 1 down packed\)"),
    "odd gate/up rows": (_with_weight(7, lambda a: torch.zeros(1, 1).expand(191, 128)),
                         r"decode_layers: weights\[7\] \(layer 0 gate/up stand-in\)"),
    "down stand-in width": (_with_weight(9, lambda a: torch.zeros(1, 1).expand(128, 95)),
                            r"decode_layers: weights\[9\] \(layer 0 down stand-in\)"),
    "starts dtype": (_set("starts", lambda a: a["lengths"].long() - 1),
                     "decode_layers: starts must be contiguous int32"),
    "starts rows": (_set("starts", lambda a: a["lengths"][:2] - 1),
                    "decode_layers: starts has 2 entries but lengths has 3"),
    "start at the length": (_set("starts", lambda a: a["lengths"].clone()),
                            r"decode_layers: starts\[0\] = \d+ is outside \[0, lengths\[0\]"),
    "negative start": (_set("starts", lambda a: torch.tensor([0, -2, 0], dtype=torch.int32)),
                       r"decode_layers: starts\[1\] = -2 is outside"),
}


@needs_ops
@pytest.mark.parametrize("case", list(BAD_DECODE_ARGS))
def test_decode_layers_refuses_bad_arguments_before_writing_a_cache(case) -> None:
    spoil, message = BAD_DECODE_ARGS[case]
    args = _decode_args()
    spoil(args)
    caches = [c.clone() for c in args["k_caches"] + args["v_caches"]]
    with pytest.raises(RuntimeError, match=message):
        _spmd().decode_layers(*args.values())
    assert all(torch.equal(c, kept) for c, kept in
               zip(args["k_caches"] + args["v_caches"], caches, strict=True))


# ---- bfloat16: bf16 storage, float32 arithmetic, each result rounded to bf16 once.

def assert_bf16_rounding_of(got: torch.Tensor, expected: torch.Tensor) -> None:
    """got (bf16) is expected (float32 arithmetic on the widened inputs) rounded to bf16: equal
    within bf16 tolerance, and bit-equal but for the few elements a float32 rounding difference
    (another order of a sum, the polynomial exp) pushes across a bf16 rounding boundary."""
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    rounded = expected.to(torch.bfloat16)
    torch.testing.assert_close(got, rounded)
    assert (got == rounded).float().mean().item() > 0.99


@needs_ops
@pytest.mark.parametrize("rows,features", [(1, 7), (5, 96), (37, 200), (64, 1000)])
def test_bf16_norms_are_float32_norms_rounded_once(rows, features) -> None:
    """Assertions on bf16 results: rms_norm's and add_rms_norm's, against float32 references of
    the widened bf16 inputs; the sum add_rms_norm returns is the float32 sum rounded to bf16,
    exactly, and its norm is taken of the float32 sum before that rounding."""
    torch.manual_seed(rows)
    x, residual = (torch.randn(rows, features + 3)[:, :features].bfloat16() for _ in range(2))
    weight = (torch.rand(features) + 0.5).bfloat16()

    def norm(v: torch.Tensor) -> torch.Tensor:
        return weight.float() * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5))

    assert_bf16_rounding_of(torch.ops.spmd_cpu.rms_norm(x, weight, 1e-5), norm(x.float()))
    total, normed = torch.ops.spmd_cpu.add_rms_norm(x, residual, weight, 1e-5)
    exact_sum = x.float() + residual.float()
    assert torch.equal(total, exact_sum.bfloat16())
    assert_bf16_rounding_of(normed, norm(exact_sum))


@needs_ops
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_bf16_rotary_is_the_float32_rotation_rounded_once(table_dtype) -> None:
    """Assertions on the bf16 qkv rotated in place, with float32 or bf16 cos/sin tables: the
    rotated heads are the float32 rotate-half formula on the widened values, rounded to bf16;
    the columns past them (the value heads) keep their bits."""
    torch.manual_seed(1)
    tokens, heads, head_dim = 9, 5, 64
    qkv = torch.randn(tokens, (heads + 2) * head_dim).bfloat16()
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.float32)
    cos, sin = (t.view(tokens, -1).to(table_dtype)
                for t in rotary.tables(torch.randint(0, 4096, (tokens,))))
    rotated = qkv.clone()
    torch.ops.spmd_cpu.rotary_(rotated, heads, head_dim, cos, sin)
    x = qkv.float()[:, :heads * head_dim].view(tokens, heads, head_dim)
    c, s = cos.float()[:, None], sin.float()[:, None]
    turned = torch.cat((-x[..., head_dim // 2:], x[..., :head_dim // 2]), dim=-1)
    assert_bf16_rounding_of(rotated[:, :heads * head_dim], (x * c + turned * s).flatten(1))
    assert torch.equal(rotated[:, heads * head_dim:], qkv[:, heads * head_dim:])


@needs_ops
@pytest.mark.parametrize("features", [1, 7, 37, 200])
def test_bf16_silu_mul_is_the_float32_product_rounded_once(features) -> None:
    """Assertions on bf16 results (vector body and scalar tail) against torch's float32 SiLU x
    up of the widened inputs; in the first row, gates where exp under- or overflows, where the
    clamped polynomial leaves a result within 1e-30 of torch's rather than its bits."""
    torch.manual_seed(features)
    gate_up = (torch.randn(5, 2 * features) * 6).bfloat16()
    gate_up[0, :min(features, 4)] = torch.tensor([-200.0, -88.0, 88.0, 200.0])[:min(features, 4)]
    gate, up = gate_up.float().split(features, dim=-1)
    got, expected = torch.ops.spmd_cpu.silu_mul(gate_up), torch.nn.functional.silu(gate) * up
    assert_bf16_rounding_of(got[1:], expected[1:])
    torch.testing.assert_close(got[:1].float(), expected[:1].bfloat16().float(), rtol=2**-8,
                               atol=1e-30)


@needs_ops
def test_float32_layer_ops_refuse_bf16_partners() -> None:
    """One dtype per call, but rotary_'s float32 tables with a bf16 qkv (assertions on the
    refusals; the bf16 results are tested above)."""
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="add_rms_norm: residual is BFloat16"):
        torch.ops.spmd_cpu.add_rms_norm(x, x.bfloat16(), torch.ones(16), 1e-5)
    with pytest.raises(RuntimeError, match="add_rms_norm: weight is Float"):
        torch.ops.spmd_cpu.add_rms_norm(x.bfloat16(), x.bfloat16(), torch.ones(16), 1e-5)


def _kernel_attention(q, k_cache, v_cache, a: dict) -> torch.Tensor:
    return torch.ops.spmd_cpu.paged_decode_attention(q, k_cache, v_cache, a["block_tables"],
                                                     a["lengths"], a["block_size"], a["scale"],
                                                     a.get("starts"))


def _decode_layer_loop(a: dict, attention=_kernel_attention) -> torch.Tensor:
    """decode_layers' operators called one by one from Python, in its order, on its arguments
    (a dict as _decode_args makes); the runtime's linear for plain bf16 projections (the bf16
    tiles at decode row counts, oneDNN's linear beyond), oneDNN's for weights it packed (shaped as
    their stand-ins), MKL's for MKL-packed float32 ones (the calls decode_layers makes), and
    `attention` for the decode attention."""
    ops, plain = torch.ops.spmd_cpu, a["x"].dtype != torch.float32
    n, heads, kv_heads, head_dim = a["x"].shape[0], a["num_heads"], a["num_kv_heads"], a["head_dim"]

    def linear(rows, w, index):
        if w[index].is_mkldnn and w[index].shape == w[index + 1].shape:
            return torch.ops.mkldnn._linear_pointwise(rows, w[index], None, "none", [], "")
        return runtime_linear(rows, w[index]) if plain else \
            torch.ops.mkl._mkl_linear(rows, w[index], w[index + 1], None, n)

    x = a["x"]
    for layer, (k_cache, v_cache) in enumerate(zip(a["k_caches"], a["v_caches"], strict=True)):
        w = a["weights"][10 * layer:10 * layer + 10]
        qkv = linear(ops.rms_norm(x, w[0], a["eps"]), w, 1)
        ops.rotary_(qkv, heads + kv_heads, head_dim, a["cos"], a["sin"])
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        ops.write_kv(k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim), k_cache,
                     v_cache, a["slots"])
        attended = attention(q.view(n, heads, head_dim), k_cache, v_cache, a)
        x, normed = ops.add_rms_norm(x, linear(attended.reshape(n, -1), w, 3), w[5], a["eps"])
        x = x + linear(ops.silu_mul(linear(normed, w, 6)), w, 8)
    return x


def _band_masked_sdpa(window: int, bf16_weights: bool = False):
    """Decode attention over each row's whole gathered context (float32 arithmetic on the
    widened cache) under an explicit band mask: the query at position p = length - 1 sees the
    keys p - window < j <= p. With `bf16_weights`, the softmax weights are rounded to bfloat16
    before the value sums and their float32 sum divides after, as the AVX512-BF16 kernels do."""
    def attention(q, k_cache, v_cache, a):
        out, bs = torch.empty_like(q), a["block_size"]
        group = q.shape[1] // k_cache.shape[1]
        for i, length in enumerate(a["lengths"].tolist()):
            slots = torch.tensor([int(a["block_tables"][i, t // bs]) * bs + t % bs
                                  for t in range(length)])
            keys = k_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)
            values = v_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)
            scores = (keys @ q[i].float()[:, :, None])[..., 0] * a["scale"]    # [heads, length]
            scores[:, torch.arange(length) <= length - 1 - window] = float("-inf")
            e = (scores - scores.max(-1, keepdim=True).values).exp()
            w = e.bfloat16().float() if bf16_weights else e
            out[i] = (w[:, None, :] @ values)[:, 0] / e.sum(-1, keepdim=True)
        return out
    return attention


def _with_cache_copies(a: dict) -> dict:
    return {**a, "k_caches": [k.clone() for k in a["k_caches"]],
            "v_caches": [v.clone() for v in a["v_caches"]]}


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 23, 1000])
def test_windowed_decode_layers_equal_the_layer_loop_and_band_masked_sdpa(dtype, window) -> None:
    """starts = max(length - window, 0) for every layer (contexts of 1-59 tokens in blocks of
    16: windows of one token, within a block, a block, unaligned, past every context): the
    hidden states equal those of the layer loop with the windowed kernel, exactly, and those of
    the loop with SDPA under a band mask to float32 rounding (bfloat16: to the bf16 rounding of
    each layer's attention, carried through two layers)."""
    args = _decode_args(layers=2, sequences=7, dtype=dtype)
    args["starts"] = (args["lengths"] - window).clamp(min=0).to(torch.int32)
    loop_args, sdpa_args = _with_cache_copies(args), _with_cache_copies(args)
    with torch.no_grad():
        fused = torch.ops.spmd_cpu.decode_layers(*args.values())
        assert torch.equal(fused, _decode_layer_loop(loop_args))
        expected = _decode_layer_loop(sdpa_args, _band_masked_sdpa(window))
    if dtype == torch.float32:
        torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)
        return
    # bf16: the kernel rounds the softmax weights to bf16 where the build has AVX512-BF16 dot
    # products and keeps them float32 elsewhere; it must match one of the two references.
    with torch.no_grad():
        rounded = _decode_layer_loop(_with_cache_copies(args), _band_masked_sdpa(window, True))
    closest = min((expected, rounded), key=lambda ref: (fused.float() - ref.float()).abs().max())
    torch.testing.assert_close(fused.float(), closest.float(), rtol=2 ** -6, atol=2 ** -6)
    for name in ("k_caches", "v_caches"):
        assert all(torch.equal(c, loop) for c, loop in zip(args[name], loop_args[name], strict=True))


@needs_ops
def test_decode_layers_with_starts_of_zero_are_unwindowed() -> None:
    args = _decode_args(layers=2, sequences=7)
    plain = _with_cache_copies(args)
    args["starts"] = torch.zeros(7, dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(torch.ops.spmd_cpu.decode_layers(*args.values()),
                           torch.ops.spmd_cpu.decode_layers(*plain.values()))


@needs_ops
@pytest.mark.parametrize("sequences", [1, 7, 64])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_bf16_decode_layers_equal_the_bf16_layer_loop_to_the_bit(sequences, table_dtype) -> None:
    """Assertions on bf16 results: decode_layers on a bf16 model (plain weights through torch's
    linear, bf16 caches, float32 or bf16 rotary tables) gives the hidden states and cache
    contents of the same bf16 operators called one by one, exactly."""
    args = _decode_args(layers=3, sequences=sequences, dtype=torch.bfloat16)
    args["cos"], args["sin"] = args["cos"].to(table_dtype), args["sin"].to(table_dtype)
    assert args["x"].dtype == torch.bfloat16
    loop_args = {**args, "k_caches": [k.clone() for k in args["k_caches"]],
                 "v_caches": [v.clone() for v in args["v_caches"]]}
    with torch.no_grad():
        fused = torch.ops.spmd_cpu.decode_layers(*args.values())
        expected = _decode_layer_loop(loop_args)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, expected)
    for name in ("k_caches", "v_caches"):
        assert all(torch.equal(c, loop) for c, loop in zip(args[name], loop_args[name], strict=True))


@needs_ops
def test_bf16_decode_layers_refuse_packed_or_float32_weights() -> None:
    """A bf16 step takes plain bf16 projections only (assertions on the refusals)."""
    args = _decode_args(layers=1, dtype=torch.bfloat16)
    packed = _decode_args(layers=1)["weights"]
    for index, wrong, message in [(1, packed[1], r"weights\[1\] \(layer 0 QKV packed\)"),
                                  (6, args["weights"][6].float(), r"weights\[6\] .* is a Float")]:
        spoiled = {**args, "weights": [wrong if i == index else w
                                       for i, w in enumerate(args["weights"])]}
        with pytest.raises(RuntimeError, match=message):
            torch.ops.spmd_cpu.decode_layers(*spoiled.values())


def test_each_family_opts_into_the_fused_paths_it_declares_and_a_new_one_into_none() -> None:
    """The fused CPU paths compute Llama's layers; a family runs them only where its own class
    says so (a subclass that changes its decoder layer inherits no fused path by accident)."""
    for architecture, family in FAMILIES.items():
        model_class = getattr(importlib.import_module(
            f"spmd_runtime.runtime.models.{family.module}"), family.class_name)
        assert "fused_cpu_paths" in vars(model_class), f"{architecture} must declare its paths"
        assert fused_cpu_paths_of(model_class) <= {LAYER_PASSES, LAYER_STACK}
    assert fused_cpu_paths_of(LlamaForCausalLM) == {LAYER_PASSES, LAYER_STACK}
    assert fused_cpu_paths_of(Gemma2ForCausalLM) == frozenset()

    class NewFamily(LlamaForCausalLM):          # a new decoder layer, no declaration
        pieces = LayerPieces(EAGER.attention_inputs, EAGER.mlp_inputs)

    model = NewFamily.__new__(NewFamily)
    assert model.layer_pieces(CPP) is NewFamily.pieces
    llama = LlamaForCausalLM.__new__(LlamaForCausalLM)
    assert llama.layer_pieces(CPP) is FUSED_CPU and llama.layer_pieces(TORCH) is EAGER
