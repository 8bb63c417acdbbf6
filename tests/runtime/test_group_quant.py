"""GGUF block-quantized weights kept quantized (runtime/layers/group_quant.py and the C++
group_quant_linear): decoding the file's blocks, slicing and stacking them as shards and fused
projections do, and the product against the float32 dequantised weight (float32 throughout)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from cpu_library import needs_cpu_ops
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.runtime.layers.group_quant import (
    GroupQuantWeight,
    from_gguf_blocks,
    group_quant_linear,
    stack_rows,
)
from spmd_runtime.runtime.loaders.gguf import load_gguf_model
from spmd_runtime.runtime.loaders.gguf_file import GGUFFile
from spmd_runtime.runtime.models import build_model

TYPES = [GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0]
# Bytes each weight is held in: 4-bit codes and two float32 per block of 32, or 8-bit codes and
# one (two with an offset).
HELD_BYTES = {GGML.Q4_0: 0.75, GGML.Q4_1: 0.75, GGML.Q5_0: 1.125, GGML.Q5_1: 1.25, GGML.Q8_0: 1.125}


def assert_product_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out == x @ weight^T up to float32 sums taken in another order: each element within
    2 K eps of the sum of its terms' magnitudes (|x| @ |weight|^T), the bound of reordering."""
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
    """Q4_K_M's fused QKV: Q4_K queries and keys beside Q6_K values (in a third of the layers)
    stack as 8-bit codes in blocks of 16, not as float32."""
    queries, q_dense = random_k_quant(GGML.Q4_K, 24, 512, seed=1)
    values, v_dense = random_k_quant(GGML.Q6_K, 8, 512, seed=2)
    legacy, l_dense = quantized(GGML.Q8_0, 16, 512)
    stacked = stack_rows([queries, values, legacy])
    assert isinstance(stacked, GroupQuantWeight)
    assert (stacked.bits, stacked.block, stacked.offsets is not None) == (8, 16, True)
    assert torch.equal(stacked.expand(), torch.cat([torch.from_numpy(d) for d in
                                                    (q_dense, v_dense, l_dense)]))


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", list(K_QUANTS))
@pytest.mark.parametrize("rows", [1, 9, 70])
def test_k_quant_products_are_the_expanded_weights_float32_product(tensor_type, rows) -> None:
    weight, expected = random_k_quant(tensor_type, 72, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    assert_product_close(group_quant_linear(x, weight, None), x, torch.from_numpy(expected))


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
    stacked = GroupQuantWeight.cat_rows([weight[:16], weight[16:]])
    assert torch.equal(stacked.expand(), dense)
    # Columns that split blocks come expanded (a shard of a width per rank not a multiple of 32).
    assert torch.equal(weight[:, 16:48], dense[:, 16:48])


@needs_cpu_ops
@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 70])
def test_the_cpu_product_is_the_expanded_weights_float32_product(tensor_type, rows) -> None:
    """Both kernels (a few rows: direct; more: tiles through the GEMM) against F.linear on the
    expanded float32 weight: the same products, summed in another order."""
    weight, expected = quantized(tensor_type, out_features=150, in_features=320, seed=rows)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
    dense = torch.from_numpy(expected)
    out = group_quant_linear(x, weight, None)
    assert out.dtype == torch.float32 and out.shape == (rows, 150)
    assert_product_close(out, x, dense)
    bias = torch.randn(150)
    with_bias = group_quant_linear(x.view(1, rows, 320), weight, bias)
    assert with_bias.shape == (1, rows, 150)
    assert_product_close(with_bias.view(rows, 150) - bias, x, dense)


@needs_cpu_ops
def test_the_cpu_product_refuses_mismatched_blocks_naming_them() -> None:
    weight, _ = quantized(GGML.Q4_1)
    with pytest.raises(RuntimeError, match="blocks are 32 weights"):
        torch.ops.spmd_cpu.group_quant_linear(torch.randn(2, 96), weight.codes, weight.scales,
                                              weight.offsets, 4, 16)
    with pytest.raises(RuntimeError, match="offsets has shape"):
        torch.ops.spmd_cpu.group_quant_linear(torch.randn(2, 96), weight.codes, weight.scales,
                                              weight.offsets[:, :1].contiguous(), 4)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.spmd_cpu.group_quant_linear(torch.randn(2, 64), weight.codes, weight.scales,
                                              weight.offsets, 4)


def random_gguf_bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "make_random_gguf.py"
    spec = importlib.util.spec_from_file_location("make_random_gguf", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_random_q4_k_m_file_loads_in_its_blocks_to_the_dequantised_models_logits(tmp_path) -> None:
    """bench/make_random_gguf.py's tiny shape in Q4_K_M (Q4_K, and Q6_K by llama-quantize's
    rule): every projection and the embedding kept in blocks, and the same logits as the file
    dequantised (float32, reordered sums)."""
    path = str(tmp_path / "tiny.gguf")
    random_gguf_bench().main(["--shape", "tiny", "--type", "Q4_K_M", path])
    kinds = {t.tensor_type.name for t in GGUFFile(path).tensors}
    assert kinds == {"Q4_K", "Q6_K", "F32"}
    config, dense = load_gguf_model(path, torch.float32)
    _, kept = load_gguf_model(path, torch.float32, keep_quantized=True)
    assert {name for name, w in kept.items() if isinstance(w, GroupQuantWeight)} == {
        name for name in kept if name.endswith(("_proj.weight", "embed_tokens.weight",
                                                "lm_head.weight"))}
    logits = []
    for weights in (dense, kept):
        model = build_model(config, torch.float32)
        model.load_hf_state_dict(weights)
        logits.append(model.eval().prompt_logits([1, 5, 9, 300, 2]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
