"""`--quantization int8` over a GGUF file: 8-bit activations (per block of 32) times the file's
own blocks of 32 (spmd_cpu::gguf_int8_linear, runtime/layers/cpu_group_quant_int8.h), its
engine wiring, and the files that keep the per-channel int8 path instead."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from cpu_library import CPU_HAS_INT8_BLOCKS, needs_int8_blocks
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.runtime.layers.group_quant import GroupQuantWeight, from_gguf_blocks, group_quant_linear
from spmd_runtime.runtime.layers.int8_blocks import (
    INT8_BLOCK_TYPES,
    INT8_FROM_ROWS,
    INT8_GATED_FROM_ROWS,
    Int8BlocksHead,
    int8_keeps_blocks,
    int8_residual_product,
    int8_silu_product,
    takes_int8,
)
from spmd_runtime.runtime.layers.quantization import quantize_linear_weights, swap_weight
from test_fused_layers import tiny_model


def blocks_of(tensor_type: GGML, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    raw = gguf.quants.quantize(w.numpy(), tensor_type)
    return torch.from_numpy(raw.reshape(out_features, -1).copy())


def k_quant_blocks() -> torch.Tensor:
    """32 rows of one Q4_K super-block of random bytes (gguf's Python cannot quantize K-quants;
    their values do not matter where the type is refused)."""
    return torch.randint(0, 256, (32, 144), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


def int8_reference(x: torch.Tensor, blocks: torch.Tensor, tensor_type: GGML) -> torch.Tensor:
    """float64: gguf's dequantized weights times x quantized as the kernel defines it, per row
    and block of 32: q = round(x * (127 / max |x|)) in float32 (ties to even), step max / 127."""
    in_features = x.shape[1]
    w = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), tensor_type)).double()
    groups = x.float().view(x.shape[0], -1, 32)
    most = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(most > 0, 127.0 / most, torch.zeros_like(most))
    codes = torch.round(groups * inverse)
    steps = most / 127.0
    return (codes.double() * steps.double()).view(-1, in_features) @ w.view(-1, in_features).t()


@needs_int8_blocks
@pytest.mark.parametrize("tensor_type", INT8_BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 20, 32, 37])
@pytest.mark.parametrize("out_features", [64, 40])
@pytest.mark.parametrize("in_features", [96, 128])
def test_8bit_activations_times_the_blocks_is_the_quantized_rows_exact_product(
        tensor_type, rows, out_features, in_features) -> None:
    """float32 (to float32 summation) and bfloat16 (to one rounding): the product is the
    dequantized weights times the rows quantized to 8 bits per block of 32, for every block
    type of 32, on the panels at every row count (full tiles of 6 rows and their tails, a
    partial panel of 32 features, in_features an odd and an even count of blocks); a zero row
    gives zeros."""
    blocks = blocks_of(tensor_type, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(out_features)) * \
        torch.logspace(-2, 1, in_features)
    if rows > 2:
        x[1] = 0.0
    out = torch.ops.spmd_cpu.gguf_int8_linear(x, blocks, int(tensor_type), in_features)
    expected = int8_reference(x, blocks, tensor_type)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    if rows > 2:
        assert not out[1].any()
    x16 = x.bfloat16()
    out16 = torch.ops.spmd_cpu.gguf_int8_linear(x16, blocks, int(tensor_type), in_features)
    expected16 = int8_reference(x16, blocks, tensor_type)
    assert out16.dtype == torch.bfloat16
    assert ((out16.double() - expected16).abs() <= 2 ** -8 * expected16.abs() + 1e-6).all()


@needs_int8_blocks
def test_the_8bit_product_refuses_bad_inputs_naming_them() -> None:
    blocks = blocks_of(GGML.Q4_1, 64, 96)
    product = torch.ops.spmd_cpu.gguf_int8_linear
    x = torch.randn(3, 96)
    for args, match in [((x.double(), blocks, int(GGML.Q4_1), 96), "float32 or bfloat16"),
                        ((x[:, :64].contiguous(), blocks, int(GGML.Q4_1), 96), "x has 64 features"),
                        ((x, blocks, int(GGML.Q8_0), 96), "bytes a row"),
                        ((x.view(3, 2, 48), blocks, int(GGML.Q4_1), 96), "must be 2-D"),
                        ((torch.randn(3, 256), k_quant_blocks(), int(GGML.Q4_K), 256),
                         "not a block of 32")]:
        with pytest.raises(RuntimeError, match=match):
            product(*args)


@needs_int8_blocks
@pytest.mark.parametrize("tensor_type", [GGML.Q4_0, GGML.Q4_1, GGML.Q8_0])
@pytest.mark.parametrize("rows", [1, 7, 20, 32, 37, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_8bit_products_are_the_product_then_silu_mul_or_the_add_to_the_bit(
        tensor_type, rows, dtype) -> None:
    """float32 and bfloat16 (bit equality in that dtype): SiLU x up in a gate/up projection's
    epilogue is silu_mul after gguf_int8_linear, and the residual added in a projection's
    epilogue is torch's add after it, on the panels (full tiles of 6 rows and their tails), over
    a partial panel (48 gate features: 32 + 16; 40 outputs: 32 + 8)."""
    ops = torch.ops.spmd_cpu
    generator = torch.Generator().manual_seed(rows)
    gate_up, down = blocks_of(tensor_type, 96, 128, seed=1), blocks_of(tensor_type, 40, 64, seed=2)
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    assert torch.equal(ops.gguf_int8_silu_linear(x, gate_up, int(tensor_type), 128),
                       ops.silu_mul(ops.gguf_int8_linear(x, gate_up, int(tensor_type), 128)))
    h = torch.randn(rows, 64, generator=generator).to(dtype)
    residual = torch.randn(rows, 40, generator=generator).to(dtype)
    fused = ops.gguf_int8_residual_linear(h, down, int(tensor_type), 64, residual)
    assert fused.dtype == dtype
    assert torch.equal(fused, residual + ops.gguf_int8_linear(h, down, int(tensor_type), 64))


@needs_int8_blocks
@pytest.mark.parametrize("rows", [17, 24, 31, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (960, 576), (576, 1536)])
def test_q4_1_decode_batches_in_the_lanes_are_the_panels_to_the_bit(rows, dtype, shape) -> None:
    """float32 and bfloat16 (bit equality in that dtype): 17-32 rows against Q4_1 blocks (N a
    multiple of 16) take the lane tiles (rows in the vector lanes, the file's blocks read in
    place); their plain and residual products equal, bit for bit, the same rows taken 16 at a
    time, which take the panels (a partial register of rows included). SmolLM2's shapes too."""
    ops = torch.ops.spmd_cpu
    out_features, in_features = shape
    kind = int(GGML.Q4_1)
    blocks = blocks_of(GGML.Q4_1, out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(out_features + rows)
    x = (torch.randn(rows, in_features, generator=generator) *
         torch.logspace(-2, 1, in_features)).to(dtype)
    residual = torch.randn(rows, out_features, generator=generator).to(dtype)
    chunks = range(0, rows, 16)
    assert torch.equal(ops.gguf_int8_linear(x, blocks, kind, in_features), torch.cat(
        [ops.gguf_int8_linear(x[i:i + 16], blocks, kind, in_features) for i in chunks]))
    assert torch.equal(
        ops.gguf_int8_residual_linear(x, blocks, kind, in_features, residual),
        torch.cat([ops.gguf_int8_residual_linear(x[i:i + 16], blocks, kind, in_features,
                                                 residual[i:i + 16]) for i in chunks]))


@needs_int8_blocks
def test_the_fused_8bit_products_refuse_bad_inputs_naming_them() -> None:
    ops = torch.ops.spmd_cpu
    q41 = int(GGML.Q4_1)
    blocks, x = blocks_of(GGML.Q4_1, 64, 96), torch.randn(3, 96)
    for residual, match in [(torch.randn(3, 64).bfloat16(), "residual must be a contiguous CPU Float"),
                            (torch.randn(3, 48), r"\[3, 64\] tensor .* got Float \[3, 48\]"),
                            (torch.randn(64, 3).t(), "residual must be a contiguous")]:
        with pytest.raises(RuntimeError, match=match):
            ops.gguf_int8_residual_linear(x, blocks, q41, 96, residual)
    with pytest.raises(RuntimeError, match="x has 64 features"):
        ops.gguf_int8_residual_linear(x[:, :64].contiguous(), blocks, q41, 96, torch.randn(3, 64))
    with pytest.raises(RuntimeError, match=r"has 48 rows \(gate first\), a multiple of 32"):
        ops.gguf_int8_silu_linear(x, blocks_of(GGML.Q4_1, 48, 96), q41, 96)
    with pytest.raises(RuntimeError, match="not a block of 32"):
        ops.gguf_int8_silu_linear(torch.randn(3, 256), k_quant_blocks(), int(GGML.Q4_K), 256)


@needs_int8_blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_loop_takes_the_8bit_epilogues_where_they_pay(dtype) -> None:
    """float32 and bfloat16 (bit equality in that dtype): SiLU x up goes into the gate/up
    product from INT8_GATED_FROM_ROWS rows where it takes 8-bit activations (below that the
    plain product and silu_mul were as fast or faster alone), the residual wherever the product
    takes them
    and the residual is in the rows' dtype and the product's shape; elsewhere the caller
    multiplies and adds."""
    def int8_weight(out_features: int, in_features: int):
        raw = blocks_of(GGML.Q4_1, out_features, in_features).numpy()
        weight = from_gguf_blocks(raw, GGML.Q4_1, (out_features, in_features), dtype)
        return dataclasses.replace(weight, int8_activations=True)

    gate_up, down = int8_weight(96, 128), int8_weight(40, 64)
    assert INT8_FROM_ROWS < INT8_GATED_FROM_ROWS
    for rows in (INT8_FROM_ROWS - 1, INT8_FROM_ROWS, INT8_GATED_FROM_ROWS - 1,
                 INT8_GATED_FROM_ROWS, 64):
        x = torch.randn(rows, 128).to(dtype)
        gated = int8_silu_product(x, gate_up)
        assert (gated is not None) == (rows >= INT8_GATED_FROM_ROWS and
                                       takes_int8(gate_up, rows))
        if gated is not None:
            assert torch.equal(gated, torch.ops.spmd_cpu.silu_mul(group_quant_linear(x, gate_up, None)))
        h, residual = torch.randn(rows, 64).to(dtype), torch.randn(rows, 40).to(dtype)
        added = int8_residual_product(residual, h, down)
        assert (added is not None) == takes_int8(down, rows)
        if added is not None:
            assert torch.equal(added, residual + group_quant_linear(h, down, None))
            other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
            assert int8_residual_product(residual.to(other), h, down) is None
            assert int8_residual_product(residual[:, :32], h, down) is None


def test_int8_keeps_only_files_of_blocks_of_32() -> None:
    assert int8_keeps_blocks(["Q4_1", "Q8_0"]) == CPU_HAS_INT8_BLOCKS
    assert not int8_keeps_blocks(["Q4_K", "Q6_K"])
    assert not int8_keeps_blocks(["Q4_0", "Q5_K"])
    assert not int8_keeps_blocks([])


def gguf_model(tensor_type: GGML, dtype: torch.dtype = torch.float32):
    model, config = tiny_model(3, dtype)
    for module, name in model.projection_slots():
        weight = getattr(module, name).float().numpy()
        raw = gguf.quants.quantize(np.ascontiguousarray(weight), tensor_type)
        swap_weight(module, name, from_gguf_blocks(raw, tensor_type, weight.shape, dtype))
    table = model.embed_tokens.float().numpy()          # the tied embedding and head, as Q8_0
    head = from_gguf_blocks(gguf.quants.quantize(np.ascontiguousarray(table), GGML.Q8_0),
                            GGML.Q8_0, table.shape, dtype)
    swap_weight(model, "embed_tokens", head)
    swap_weight(model, "lm_head", head)
    return model, config


@needs_int8_blocks
def test_an_int8_model_keeps_the_files_blocks_and_its_predictions() -> None:
    """float32 (assertions on float32 logits): quantizing a model held in GGUF blocks marks its
    projections for 8-bit activations without copying a byte of them, puts an Int8BlocksHead
    over the head's own blocks (the tied embedding's, not a copy), and its prompt logits stay
    the blocks' own within the activations' rounding."""
    model, config = gguf_model(GGML.Q4_1)
    before = [getattr(module, name) for module, name in model.projection_slots()]
    ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(2))
    exact = model.prompt_logits(ids.tolist())
    head = model.lm_head
    assert quantize_linear_weights(model, "int8") == 4 * config.num_hidden_layers + 1
    for (module, name), held in zip(model.projection_slots(), before, strict=True):
        weight = getattr(module, name)
        assert isinstance(weight, GroupQuantWeight) and weight.int8_activations
        assert weight.parts[0].data.data_ptr() == held.parts[0].data.data_ptr()
    assert isinstance(model.lm_head, Int8BlocksHead) and model.lm_head.weight is head
    assert model.embed_tokens is head
    quantized = model.prompt_logits(ids.tolist())
    assert 0 < ((quantized - exact).norm() / exact.norm()).item() < 0.02
    assert (quantized.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.9


@needs_int8_blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_products_take_8bit_activations_at_their_row_counts(dtype) -> None:
    """float32 and bfloat16 (bit-equality of products in that dtype): an int8 weight's product
    is the 8-bit one at takes_int8's row counts (every one from INT8_FROM_ROWS) and the blocks'
    own at the others (none: an empty batch)."""
    weight = from_gguf_blocks(blocks_of(GGML.Q8_0, 64, 128).numpy(), GGML.Q8_0, (64, 128), dtype)
    int8 = dataclasses.replace(weight, int8_activations=True)
    part = weight.parts[0]
    assert not takes_int8(weight, 64)
    assert INT8_FROM_ROWS == 1 and not takes_int8(int8, 0)
    for rows in (1, 2, 7, 16, 32, 33, 48, 49):
        x = torch.randn(rows, 128).to(dtype)
        blocks_own = group_quant_linear(x, weight, None)
        eight_bit = torch.ops.spmd_cpu.gguf_int8_linear(x, part.data, int(part.kind), 128)
        assert not torch.equal(blocks_own, eight_bit)
        assert takes_int8(int8, rows)
        assert torch.equal(group_quant_linear(x, int8, None), eight_bit)


@needs_int8_blocks
def test_a_k_quant_weight_is_not_marked_for_8bit_activations() -> None:
    model, _ = gguf_model(GGML.Q4_1)
    k_quant = from_gguf_blocks(k_quant_blocks().numpy(), GGML.Q4_K, (32, 256))
    swap_weight(model.layers[0].self_attn, "o_proj", k_quant)
    with pytest.raises(ValueError, match=r"cannot multiply o_proj's GGUF blocks \(Q4_K\)"):
        quantize_linear_weights(model, "int8")
