"""GGUF block-quantized weights kept quantized (runtime/layers/group_quant.py and the C++
gguf_linear): the file's blocks held as they are, sliced and stacked as shards and fused
projections do, and the products (float32 throughout): up to group_quant.f32_integer_rows rows
against the dequantised weight times the activations as 16-bit fixed point per block of 32
(integer dot products), past it against the float32 activations (the float32 panels, or MKL's
GEMM of dequantized chunks)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from cpu_library import CPU_HAS_BF16, needs_bf16_tiles, needs_cpu_ops
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.runtime.layers import group_quant
from spmd_runtime.runtime.layers.group_quant import (
    GroupQuantWeight,
    from_gguf_blocks,
    group_quant_linear,
    stack_rows,
)
from spmd_runtime.runtime.layers.linear import logits_linear
from spmd_runtime.runtime.layers.parallel import TensorParallel, residual_row_parallel_linear
from spmd_runtime.runtime.loaders.gguf import load_gguf_model
from spmd_runtime.runtime.loaders.gguf_file import GGUFFile
from spmd_runtime.runtime.models import build_model

TYPES = [GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0]
# Bytes each weight is held in: the file's, a block's bytes over its 32 weights.
HELD_BYTES = {GGML.Q4_0: 18 / 32, GGML.Q4_1: 20 / 32, GGML.Q5_0: 22 / 32, GGML.Q5_1: 24 / 32,
              GGML.Q8_0: 34 / 32}


def activation_group(tensor_type: GGML) -> int:
    """How many of x's values share a 16-bit scale in the kernel's products with `tensor_type`:
    a K-quant's super-block of 256 where the loaded library has AVX512-VNNI (its integer
    sums run across the super-block), else a block of 32."""
    return 256 if group_quant.vnni_kernels() and tensor_type in K_QUANTS else 32


def activations_as_multiplied(x: torch.Tensor, group: int, integer_rows: int) -> torch.Tensor:
    """x as the kernel multiplies it: up to integer_rows rows, each `group` values as 16-bit
    fixed point (scale max|x| / 32767, round to nearest even) and back; past it, x itself."""
    if x.shape[0] > integer_rows:
        return x
    blocks = x.view(x.shape[0], -1, group)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 32767)).view_as(x)


def assert_product_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         tensor_type: GGML) -> None:
    """out == x' @ weight^T, x' = x as `tensor_type`'s products at x's row count multiply it
    (activations_as_multiplied), up to float32 sums taken in another order: each element within
    2 K eps of the sum of its terms' magnitudes (|x| @ |weight|^T), the bound of reordering."""
    integer_rows = group_quant.f32_integer_rows(tensor_type, weight.shape[1], weight.shape[0])
    x = activations_as_multiplied(x, activation_group(tensor_type), integer_rows)
    assert_reordered_sum(out, x, weight)


def assert_reordered_sum(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out == x @ weight^T up to float32 sums taken in another order (2 K eps of the sum of the
    terms' magnitudes)."""
    reference = x.double() @ weight.double().t()
    bound = 2 * x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs().double()
                                                                 @ weight.abs().double().t())
    error = (out.double() - reference).abs()
    assert bool((error <= bound + 1e-30).all()), float((error - bound).max())


def quantized(tensor_type: GGML, out_features: int = 48, in_features: int = 96,
              seed: int = 0) -> tuple[GroupQuantWeight, np.ndarray]:
    """A random weight in `tensor_type`'s blocks, and gguf's own dequantisation of them."""
    rng = np.random.default_rng(seed)
    raw = gguf.quants.quantize(rng.standard_normal((out_features, in_features), np.float32),
                               tensor_type)
    expected = gguf.quants.dequantize(raw, tensor_type).reshape(out_features, in_features)
    return from_gguf_blocks(raw, tensor_type, (out_features, in_features)), expected


# Bytes per super-block of 256 weights, and where its float16 fields lie (gguf-py cannot
# quantize to the K-quants; any bytes are valid codes and scales, the float16 ones are set).
K_QUANTS = {GGML.Q4_K: (144, (0, 2)), GGML.Q5_K: (176, (0, 2)), GGML.Q6_K: (210, (208,))}


def random_k_quant(tensor_type: GGML, out_features: int, in_features: int,
                   seed: int = 0) -> tuple[GroupQuantWeight, np.ndarray]:
    """A `tensor_type` tensor of random super-blocks with float16 scales of a real file's size,
    as kept, and gguf's own dequantisation of its bytes."""
    size, halves = K_QUANTS[tensor_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // 256, size), dtype=np.uint8)
    for offset in halves:
        scale = rng.uniform(1e-3, 2e-2, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    raw = blocks.reshape(out_features, -1)
    expected = gguf.quants.dequantize(raw, tensor_type).reshape(out_features, in_features)
    return from_gguf_blocks(raw, tensor_type, (out_features, in_features)), expected


@pytest.mark.parametrize("tensor_type", list(K_QUANTS))
def test_k_quant_super_blocks_expand_to_ggufs_own_dequantisation_bit_for_bit(tensor_type) -> None:
    weight, expected = random_k_quant(tensor_type, 40, 512)
    assert torch.equal(weight.expand(), torch.from_numpy(expected))
    dense = torch.from_numpy(expected)
    assert torch.equal(weight[8:20, 256:512].expand(), dense[8:20, 256:512])
    rows = torch.tensor([39, 2, 2, 17])
    assert torch.equal(weight[rows].expand(), dense[rows])
    assert torch.equal(weight[:30].pad_rows(32).expand(), torch.cat([dense[:30], torch.zeros(2, 512)]))


def test_parts_of_different_layouts_stack_without_being_expanded() -> None:
    """Q4_K_M's fused QKV: Q4_K queries and keys beside Q6_K values (in half the layers) stack
    as one run of blocks per type, each as the file holds it, not as float32; a slice of rows
    takes the runs it crosses."""
    queries, q_dense = random_k_quant(GGML.Q4_K, 24, 512, seed=1)
    keys, k_dense = random_k_quant(GGML.Q4_K, 8, 512, seed=3)
    values, v_dense = random_k_quant(GGML.Q6_K, 8, 512, seed=2)
    stacked = stack_rows([queries, keys, values])
    assert isinstance(stacked, GroupQuantWeight)
    assert [(p.kind, p.data.shape[0]) for p in stacked.parts] == [(GGML.Q4_K, 32), (GGML.Q6_K, 8)]
    held = sum(t.numel() for t in stacked.tensors())
    assert held == sum(t.numel() for w in (queries, keys, values) for t in w.tensors())
    dense = torch.cat([torch.from_numpy(d) for d in (q_dense, k_dense, v_dense)])
    assert torch.equal(stacked.expand(), dense)
    assert torch.equal(stacked[28:36].expand(), dense[28:36])
    assert torch.equal(stacked[:, 256:].expand(), dense[:, 256:])
    with pytest.raises(ValueError, match="slice"):
        stacked[torch.tensor([0, 30])]


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", list(K_QUANTS))
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 9, 32, 70, 130])
def test_k_quant_products_are_the_expanded_weights_float32_product(tensor_type, rows) -> None:
    """Every row count's kernel (AVX512-VNNI: one feature at a time up to 5 rows of Q4_K and
    Q5_K, 1 of Q6_K; past them four features at a time, 75 = 18 x 4 + a tail of 3; past
    f32_integer_rows the float32 panels) against the expanded weights, x quantized as the
    kernel holds it."""
    weight, expected = random_k_quant(tensor_type, 75, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    # An outlier in one block: a scale shared by a super-block makes its other blocks coarser,
    # which only the right group in activations_as_multiplied accounts for.
    x[:, 40] *= 1000
    assert_product_close(group_quant_linear(x, weight, None), x, torch.from_numpy(expected),
                         tensor_type)


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", list(K_QUANTS))
@pytest.mark.parametrize("rows", [1, 3])
def test_long_k_quant_rows_take_the_tiles_from_one_row(tensor_type, rows) -> None:
    """in_features >= 8192 (a row of x's codes past L1): four features at a time from one row
    on AVX512-VNNI, against the expanded weights."""
    weight, expected = random_k_quant(tensor_type, 9, 8192, seed=rows)
    x = torch.randn(rows, 8192, generator=torch.Generator().manual_seed(rows))
    x[:, 4000] *= 1000
    assert_product_close(group_quant_linear(x, weight, None), x, torch.from_numpy(expected),
                         tensor_type)


@pytest.mark.parametrize("tensor_type", TYPES)
def test_the_blocks_expand_to_ggufs_own_dequantisation_bit_for_bit(tensor_type) -> None:
    weight, expected = quantized(tensor_type)
    assert weight.shape == (48, 96)
    assert torch.equal(weight.expand(), torch.from_numpy(expected))
    rows = torch.tensor([5, 0, 47, 5])
    assert torch.equal(weight.embedding(rows), torch.from_numpy(expected)[rows])
    held = sum(t.numel() * t.element_size() for t in weight.tensors())
    assert held / weight.shape.numel() == HELD_BYTES[tensor_type]


@pytest.mark.parametrize("tensor_type", TYPES)
def test_shards_and_stacks_are_the_slices_of_the_expanded_weight(tensor_type) -> None:
    weight, expected = quantized(tensor_type)
    dense = torch.from_numpy(expected)
    assert torch.equal(weight[8:24].expand(), dense[8:24])
    assert torch.equal(weight[:, 32:96].expand(), dense[:, 32:96])
    permuted = torch.randperm(48)
    assert torch.equal(weight[permuted].expand(), dense[permuted])
    stacked = stack_rows([weight[:16], weight[16:]])
    assert len(stacked.parts) == 1
    assert torch.equal(stacked.expand(), dense)
    # Columns that split blocks come expanded (a shard of a width per rank not a multiple of 32).
    assert torch.equal(weight[:, 16:48], dense[:, 16:48])


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16, 32, 70])
def test_the_cpu_product_is_the_expanded_weights_float32_product(tensor_type, rows) -> None:
    """Both kernels (up to f32_integer_rows rows: 16-bit activations, integer dot products;
    more: the float32 panels, or tiles through the GEMM) against the expanded float32 weight's
    product: the same products, summed in another order."""
    weight, expected = quantized(tensor_type, out_features=150, in_features=320, seed=rows)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
    dense = torch.from_numpy(expected)
    out = group_quant_linear(x, weight, None)
    assert out.dtype == torch.float32 and out.shape == (rows, 150)
    assert_product_close(out, x, dense, tensor_type)
    bias = torch.randn(150)
    with_bias = group_quant_linear(x.view(1, rows, 320), weight, bias)
    assert with_bias.shape == (1, rows, 150)
    assert_product_close(with_bias.view(rows, 150) - bias, x, dense, tensor_type)


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", [*TYPES, *K_QUANTS])
@pytest.mark.parametrize("rows,out_features", [
    (1, 300), (2, 300), (9, 300), (15, 300), (16, 300), (17, 300), (20, 20), (32, 300),
    (33, 300), (48, 300), (49, 300), (64, 300), (130, 300)])
def test_the_float32_panels_multiply_ggufs_own_weights(tensor_type, rows, out_features) -> None:
    """float32 (assertions on float32 sums): gguf_linear with no integer rows multiplies the
    weights gguf dequantizes, in float32, through every kernel that takes its rows where the
    library has the float32 panels (AVX-512): below 16 rows row-major panels of 8 (a lone last
    row paired with itself), 16-48 rows in the lanes against 16-, 12- or 8-feature panels,
    from 49 packed 32-feature panels in tiles of 12 rows and their tails; out_features 300 or
    20, a multiple of no panel width but 12 (the last panel overlaps the one before). Where the
    library has no panels, MKL's GEMM of dequantized chunks, to the same bound."""
    weight, expected = (random_k_quant(tensor_type, out_features, 512, seed=rows)
                        if tensor_type in K_QUANTS else
                        quantized(tensor_type, out_features=out_features, in_features=512,
                                  seed=rows))
    blocks = weight.parts[0].data
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    out = torch.ops.spmd_cpu.gguf_linear(x, blocks, int(tensor_type), 512, 0)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    assert_reordered_sum(out, x, torch.from_numpy(expected))
    # Each output is its own row's and feature's: a row or a feature moved would be caught.
    assert torch.equal(torch.ops.spmd_cpu.gguf_linear(x.flip(0).contiguous(), blocks,
                                                      int(tensor_type), 512, 0), out.flip(0))


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", [GGML.Q4_1, GGML.Q8_0, GGML.Q6_K])
@pytest.mark.parametrize("rows", [1, 2, 12, 13, 25, 26, 32, 33, 129, 300])
def test_bf16_prompts_multiply_the_weights_rounded_to_bf16(tensor_type, rows, monkeypatch) -> None:
    """bfloat16 activations (assertions on bf16 products): up to bf16_gemm_rows rows (1 where
    the library has the fused bf16 kernel, 12 where not; a K-quant's with AVX512-VNNI 19-25
    with the fused kernel, K_QUANT_INTEGER_ROWS, and 32 without), the
    integer products of float32 (the bf16 values widened), rounded to bfloat16; past it, the
    weight dequantized and rounded to bfloat16: a panel at a time inside the fused kernel
    (the float32 product of the rounded weight, rounded once), or a chunk of output features
    at a time (chunks of 64 here, 5 of them) through the bf16 GEMM; F.linear of the rounded
    weight, as one product, within bf16's rounding."""
    monkeypatch.setattr(group_quant, "BF16_CHUNK_VALUES", 64 * 512)
    if tensor_type in K_QUANTS:
        weight, expected = random_k_quant(tensor_type, 300, 512, seed=rows)
    else:
        weight, expected = quantized(tensor_type, out_features=300, in_features=512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = group_quant_linear(x, weight, None)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 300)
    dense = torch.from_numpy(expected)
    if rows <= group_quant.bf16_gemm_rows(tensor_type, 512, 300):
        assert torch.equal(out, group_quant_linear(x.float(), weight, None).bfloat16())
    else:
        if CPU_HAS_BF16:
            rounded = torch.ops.spmd_cpu.gguf_dequantize_bf16(weight.parts[0].data,
                                                              int(tensor_type), 512)
            assert torch.equal(out, torch.ops.spmd_cpu.gguf_bf16_linear(
                x, weight.parts[0].data, int(tensor_type), 512))
            assert_rounded_product(out, x, rounded)
        reference = torch.nn.functional.linear(x, dense.bfloat16())
        torch.testing.assert_close(out, reference, rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(out.float(), x.float() @ dense.t(), rtol=0.05,
                               atol=0.05 * float((x.float() @ dense.t()).abs().mean()))


def assert_rounded_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out (bf16) is x @ weight^T (bf16 operands) summed in float32 in some order and rounded
    to bfloat16 once: within half a bf16 step of the exact product's rounding, plus the bound of
    reordering a float32 sum (2 K eps of the sum of the terms' magnitudes)."""
    exact = x.double() @ weight.double().t()
    slack = 2 * x.shape[1] * torch.finfo(torch.float32).eps * (
        x.double().abs() @ weight.double().abs().t())
    bound = (exact.abs() + slack) * 2.0 ** -8 + slack
    assert bool(((out.double() - exact).abs() <= bound).all()), \
        float(((out.double() - exact).abs() - bound).max())


@needs_bf16_tiles
@pytest.mark.parametrize("tensor_type", [*TYPES, *K_QUANTS])
@pytest.mark.parametrize("rows,out_features", [
    (1, 300), (2, 300), (5, 300), (15, 300), (16, 300), (17, 300), (20, 20), (32, 300),
    (33, 300), (48, 300), (49, 300), (64, 300), (130, 300)])
def test_the_fused_bf16_product_is_the_rounded_weights_product(tensor_type, rows,
                                                               out_features) -> None:
    """bfloat16 (assertions on bf16 values): gguf_bf16_linear multiplies the weight as
    gguf_dequantize_bf16 rounds it: below 16 rows with bf16_linear's bits (the same few-row
    tiles); from 16 rows the float32 product rounded once, through both kernels that take them
    (16-48 rows: the rows in the lanes against 16-, 12- or 8-feature panels, whole and partial
    registers of rows; from 49: packed 32-feature panels, tiles of 12 rows and their tails), for
    every block type and an out_features (300, or 20 < 32) that is a multiple of no panel width
    but 12 (the last panel overlaps the one before). With float32_out (float32 assertions) the
    same sums unrounded: within float32 reordering of the rounded weights' product, and
    rounding to the bf16 result bit for bit."""
    weight, _ = (random_k_quant(tensor_type, out_features, 512, seed=rows)
                 if tensor_type in K_QUANTS else
                 quantized(tensor_type, out_features=out_features, in_features=512, seed=rows))
    blocks = weight.parts[0].data
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    rounded = torch.ops.spmd_cpu.gguf_dequantize_bf16(blocks, int(tensor_type), 512)
    fused = torch.ops.spmd_cpu.gguf_bf16_linear(x, blocks, int(tensor_type), 512)
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, out_features)
    if rows < 16:
        assert torch.equal(fused, torch.ops.spmd_cpu.bf16_linear(x, rounded))
    assert_rounded_product(fused, x, rounded)
    sums = torch.ops.spmd_cpu.gguf_bf16_linear(x, blocks, int(tensor_type), 512, True)
    assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), fused)
    assert_reordered_sum(sums, x.float(), rounded.float())
    # Each output is its own row's and feature's: a row or a feature moved would be caught.
    assert torch.equal(torch.ops.spmd_cpu.gguf_bf16_linear(x.flip(0).contiguous(), blocks,
                                                           int(tensor_type), 512), fused.flip(0))


@needs_bf16_tiles
@pytest.mark.parametrize("tensor_type", [GGML.Q4_1, GGML.Q8_0, GGML.Q4_K])
@pytest.mark.parametrize("rows", [2, 5, 16, 20, 48, 49, 64, 130])
def test_the_residual_product_is_the_residual_plus_the_product_bit_for_bit(tensor_type,
                                                                           rows) -> None:
    """bfloat16 (assertions on bf16 bits): gguf_bf16_residual_linear(x, W, r) is r +
    gguf_bf16_linear(x, W) as torch adds two bf16 tensors, through each kernel shape (few
    rows, the lanes, the packed panels' epilogue and their row tails); residual_row_parallel_
    linear takes it on one rank and is the same add."""
    weight, _ = (random_k_quant(tensor_type, 300, 512, seed=rows) if tensor_type in K_QUANTS
                 else quantized(tensor_type, out_features=300, in_features=512, seed=rows))
    blocks = weight.parts[0].data
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=generator).bfloat16()
    residual = (10 * torch.randn(rows, 300, generator=generator)).bfloat16()
    expected = residual + torch.ops.spmd_cpu.gguf_bf16_linear(x, blocks, int(tensor_type), 512)
    fused = torch.ops.spmd_cpu.gguf_bf16_residual_linear(x, blocks, int(tensor_type), 512,
                                                         residual)
    assert torch.equal(fused, expected)
    one_rank = TensorParallel()
    assert torch.equal(residual_row_parallel_linear(residual, x, weight, one_rank),
                       residual + group_quant_linear(x, weight, None))


@needs_bf16_tiles
def test_the_residual_product_refuses_a_residual_of_another_shape_or_dtype() -> None:
    weight, _ = quantized(GGML.Q4_1, out_features=48, in_features=96)
    x = torch.randn(3, 96).bfloat16()
    for residual, got in ((torch.zeros(3, 47).bfloat16(), r"\[3, 47\]"),
                          (torch.zeros(3, 48), "Float"), (torch.zeros(48, 3).bfloat16().t(), "")):
        with pytest.raises(RuntimeError, match=r"residual must be a contiguous bfloat16 \[3, "
                                               r"48\] tensor, got .*" + got):
            torch.ops.spmd_cpu.gguf_bf16_residual_linear(x, weight.parts[0].data,
                                                         int(GGML.Q4_1), 96, residual)


@needs_cpu_ops
@pytest.mark.parametrize("rows", [1, 5, 20, 64])
def test_logits_products_are_float32_whatever_the_rows_dtype(rows) -> None:
    """The LM head's product (logits_linear) of bf16 rows and GGUF blocks, a weight of two
    types: float32 logits, the very sums that group_quant_linear rounds to bf16 (assertions on
    float32 values and their bf16 rounding), at a lone row (integer products), few rows, the
    lanes and the panels."""
    weight = stack_rows([quantized(GGML.Q8_0, out_features=40, in_features=512, seed=1)[0],
                         quantized(GGML.Q4_1, out_features=48, in_features=512, seed=2)[0]])
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    logits = logits_linear(x, weight)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 88)
    assert torch.equal(logits.bfloat16(), group_quant_linear(x, weight, None))


@needs_bf16_tiles
@pytest.mark.parametrize("op", ["gguf_bf16_linear", "gguf_bf16_silu_linear"])
def test_the_fused_bf16_products_refuse_bad_inputs_naming_them(op) -> None:
    """The plain product and the one with SiLU in its gate/up tiles check x and the blocks
    alike; each refuses the weights its tiles cannot take."""
    weight, _ = quantized(GGML.Q4_1, out_features=48, in_features=96)
    blocks, q4_1 = weight.parts[0].data, int(GGML.Q4_1)
    fused = getattr(torch.ops.spmd_cpu, op)
    cases = [((torch.randn(2, 96), blocks, q4_1, 96), "contiguous bfloat16"),
             ((torch.randn(96, 2).bfloat16().t(), blocks, q4_1, 96), "contiguous bfloat16"),
             ((torch.randn(2, 64).bfloat16(), blocks, q4_1, 96), "x has 64 features, the weight 96"),
             ((torch.randn(2, 64).bfloat16(), blocks, q4_1, 64), "60 bytes a row, 40 expected"),
             ((torch.randn(2, 96).bfloat16(), blocks, 1, 96), "GGML type 1 has no kernel")]
    if op == "gguf_bf16_linear":
        cases.append(((torch.randn(2, 96).bfloat16(), blocks[:4], q4_1, 96), "out_features >= 8"))
    else:
        cases.append(((torch.randn(2, 96).bfloat16(), blocks, q4_1, 96),
                      r"multiple of 32, got \[48, 96\]"))
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            fused(*args)


@needs_bf16_tiles
@pytest.mark.parametrize("tensor_type", [*TYPES, *K_QUANTS])
@pytest.mark.parametrize("rows", [16, 20, 48, 49, 64, 130])
def test_silu_in_the_gate_up_tiles_is_silu_mul_of_the_product(tensor_type, rows) -> None:
    """bfloat16 (assertions on bf16 values): gguf_bf16_silu_linear over a fused gate/up
    weight (gate rows first; 96 intermediate features: three panels of 16 gate and 16 up
    features) is, bit for bit, silu_mul of gguf_bf16_linear's product from 16 rows (where that
    sums in the packed panels' order), the last packed tile's tails included."""
    weight, _ = (random_k_quant(tensor_type, 192, 512, seed=rows) if tensor_type in K_QUANTS
                 else quantized(tensor_type, out_features=192, in_features=512, seed=rows))
    blocks = weight.parts[0].data
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    gated = torch.ops.spmd_cpu.gguf_bf16_silu_linear(x, blocks, int(tensor_type), 512)
    assert gated.dtype == torch.bfloat16 and gated.shape == (rows, 96)
    product = torch.ops.spmd_cpu.gguf_bf16_linear(x, blocks, int(tensor_type), 512)
    assert torch.equal(gated, torch.ops.spmd_cpu.silu_mul(product))
    # The layer's path: only past GATED_FROM_ROWS, and only for bf16 rows.
    through_layer = group_quant.silu_gated_product(x, weight)
    assert (through_layer is not None) == (rows >= group_quant.GATED_FROM_ROWS)
    if through_layer is not None:
        assert torch.equal(through_layer, gated)
    assert group_quant.silu_gated_product(x.float(), weight) is None


@needs_cpu_ops
def test_the_cpu_product_refuses_mismatched_blocks_naming_them() -> None:
    weight, _ = quantized(GGML.Q4_1)
    blocks = weight.parts[0].data
    with pytest.raises(RuntimeError, match="60 bytes a row, 40 expected"):
        torch.ops.spmd_cpu.gguf_linear(torch.randn(2, 64), blocks, int(GGML.Q4_1), 64)
    with pytest.raises(RuntimeError, match="x has 64 features, the weight 96"):
        torch.ops.spmd_cpu.gguf_linear(torch.randn(2, 64), blocks, int(GGML.Q4_1), 96)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.spmd_cpu.gguf_linear(torch.randn(2, 96), blocks, int(GGML.Q4_K), 96)
    with pytest.raises(RuntimeError, match="GGML type 1 has no kernel"):
        torch.ops.spmd_cpu.gguf_linear(torch.randn(2, 96), blocks, 1, 96)
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        torch.ops.spmd_cpu.gguf_linear(torch.randn(2, 96), blocks.view(torch.int8), int(GGML.Q4_1), 96)
    for dequantize in (torch.ops.spmd_cpu.gguf_dequantize, torch.ops.spmd_cpu.gguf_dequantize_bf16):
        with pytest.raises(RuntimeError, match="60 bytes a row, 40 expected"):
            dequantize(blocks, int(GGML.Q4_1), 64)
        with pytest.raises(RuntimeError, match="GGML type 1 has no kernel"):
            dequantize(blocks, 1, 96)


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", [*TYPES, *K_QUANTS])
def test_the_cpu_dequantisation_is_ggufs(tensor_type) -> None:
    """The tiles the GEMM multiplies: gguf's dequantisation, within one rounding of each
    weight (the C++ may fuse a multiply and add)."""
    weight, expected = (random_k_quant(tensor_type, 24, 512) if tensor_type in K_QUANTS
                        else quantized(tensor_type))
    tiles = torch.ops.spmd_cpu.gguf_dequantize(weight.parts[0].data, int(tensor_type),
                                               weight.in_features)
    torch.testing.assert_close(tiles, torch.from_numpy(expected), rtol=2 ** -22, atol=0)
    # bfloat16 (assertion on bf16 values): the same float32 values, rounded as torch rounds.
    rounded = torch.ops.spmd_cpu.gguf_dequantize_bf16(weight.parts[0].data, int(tensor_type),
                                                      weight.in_features)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, tiles.bfloat16())


def random_gguf_bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "make_random_gguf.py"
    spec = importlib.util.spec_from_file_location("make_random_gguf", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_random_q4_k_m_file_loads_in_its_blocks_to_the_dequantised_models_logits(tmp_path) -> None:
    """bench/make_random_gguf.py's tiny shape in Q4_K_M (Q4_K, and Q6_K by llama-quantize's
    rule): every projection and the embedding kept in blocks. A 140-token prompt (float32
    activations, past the K-quants' integer rows) gives the dequantised model's logits up to
    reordered sums; a 5-token one (16-bit fixed-point activations) the same argmax, within 1e-4
    in norm."""
    path = str(tmp_path / "tiny.gguf")
    random_gguf_bench().main(["--shape", "tiny", "--type", "Q4_K_M", path])
    kinds = {t.tensor_type.name for t in GGUFFile(path).tensors}
    assert kinds == {"Q4_K", "Q6_K", "F32"}
    config, kept = load_gguf_model(path, torch.float32, keep_quantized=True)
    assert {name for name, w in kept.items() if isinstance(w, GroupQuantWeight)} == {
        name for name in kept if name.endswith(("_proj.weight", "embed_tokens.weight",
                                                "lm_head.weight"))}
    models = []
    for keep in (False, True):
        model = build_model(config, torch.float32)
        model.load_hf_state_dict(load_gguf_model(path, torch.float32, keep_quantized=keep)[1])
        models.append(model.eval())
    assert 140 > max(group_quant.f32_integer_rows(kind, 256, 256) for kind in K_QUANTS)
    dense, blocks = (model.prompt_logits(list(range(1, 141))) for model in models)
    torch.testing.assert_close(blocks, dense, rtol=1e-4, atol=1e-4)
    dense, blocks = (model.prompt_logits([1, 5, 9, 300, 2]) for model in models)
    assert torch.equal(blocks.argmax(-1), dense.argmax(-1))
    assert float((blocks - dense).norm() / dense.norm()) < 1e-4


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", list(K_QUANTS))
@pytest.mark.parametrize("rows", [1, 4])
def test_k_quant_products_do_not_overflow_at_the_largest_codes_and_scales(tensor_type, rows) -> None:
    """Every code and block scale at its largest (Q6_K: q 63, sub-scales 127) against equal
    activations: the integer sums run to ~8.4e9 a block, past int32, and must still give the
    float32 product."""
    size, halves = K_QUANTS[tensor_type]
    blocks = np.full((8, 2, size), 0xFF, dtype=np.uint8)
    if tensor_type == GGML.Q6_K:
        blocks[..., 192:208] = 127
    for offset in halves:
        blocks[..., offset:offset + 2] = np.array([1e-3], np.float16).view(np.uint8)
    raw = blocks.reshape(8, -1)
    weight = from_gguf_blocks(raw, tensor_type, (8, 512))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, tensor_type).reshape(8, 512))
    x = torch.full((rows, 512), 3.0)
    assert_product_close(group_quant_linear(x, weight, None), x, dense, tensor_type)


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", [GGML.Q4_1, GGML.Q4_K, GGML.Q6_K])
def test_row_parallel_shards_partial_products_sum_to_the_whole(tensor_type) -> None:
    """A row-parallel layer's ranks each hold whole blocks of its columns (kept, not expanded)
    and multiply their slice of x: the partial products add up to one rank's product."""
    weight, _ = (random_k_quant(tensor_type, 24, 1024) if tensor_type in K_QUANTS
                 else quantized(tensor_type, 24, 1024))
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0))
    shards = [weight[:, start:start + 512] for start in (0, 512)]
    assert all(isinstance(shard, GroupQuantWeight) for shard in shards)
    shards = [shard.contiguous() for shard in shards]     # as assign_weight holds them
    parts = sum(group_quant_linear(x[:, start:start + 512], shard, None)
                for start, shard in zip((0, 512), shards, strict=True))
    torch.testing.assert_close(parts, group_quant_linear(x, weight, None), rtol=1e-5, atol=1e-4)


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_type", [GGML.Q8_0, GGML.Q4_1])
def test_an_embedding_lookup_is_ggufs_dequantisation_of_its_rows(dtype, tensor_type) -> None:
    """float32 and bfloat16 (assertions on the looked-up rows in that dtype, exact): Q8_0 rows
    come from the library, other types from gguf; both are gguf's values, rounded to bf16 as
    torch rounds them."""
    from dataclasses import replace

    weight, expected = quantized(tensor_type, out_features=80, in_features=64)
    weight = replace(weight, dtype=dtype)
    ids = torch.tensor([[3, 79, 0, 3], [41, 12, 66, 5]])
    rows = weight.embedding(ids)
    assert rows.dtype == dtype and rows.shape == (2, 4, 64)
    assert torch.equal(rows, torch.from_numpy(expected)[ids].to(dtype))
    assert weight.embedding(torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3, 64)
