"""GGUF blocks dequantized with torch operations alone (runtime/layers/gguf_torch.py, the non-CPU
path of `--quantization gguf`): gguf's own dequantisation (gguf.quants.dequantize), bit for bit,
of blocks gguf quantized and of random bytes with sane float16 scales, on the CPU and, where
there is one, a CUDA device; the output stays on the blocks' device."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.protocol.buckets import graphs_enabled
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime.layers import cpu_ops
from spmd_runtime.runtime.layers.gguf_torch import SUPPORTED_TYPES, dequantize
from spmd_runtime.runtime.layers.group_quant import (
    GroupQuantWeight,
    assign_weight,
    group_quant_linear,
    move_to,
    stack_rows,
)
from test_group_quant import (
    K_QUANTS,
    TYPES,
    assert_product_close,
    assert_reordered_sum,
    quantized,
    random_k_quant,
)

ROWS, IN_FEATURES = 24, 512
# Where the legacy types' float16 fields lie in a block (d; Q4_1 and Q5_1 also m).
LEGACY_HALVES = {GGML.Q4_0: (0,), GGML.Q4_1: (0, 2), GGML.Q5_0: (0,), GGML.Q5_1: (0, 2),
                 GGML.Q8_0: (0,)}


def random_legacy(kind: GGML, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes a row] of random `kind` blocks whose float16 fields are set to
    +-0.01..1.0 (any other bytes are valid codes)."""
    per_block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, in_features // per_block, size), dtype=np.uint8)
    for offset in LEGACY_HALVES[kind]:
        sign = rng.choice(np.array([-1.0, 1.0]), blocks.shape[:2])
        half = (sign * rng.uniform(0.01, 1.0, blocks.shape[:2])).astype(np.float16)
        blocks[..., offset:offset + 2] = half[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def random_blocks(kind: GGML, rows: int = ROWS, in_features: int = IN_FEATURES,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random `kind` blocks as uint8 [rows, bytes a row] and gguf's float32 [rows, in]
    dequantisation of them (the K-quants from test_group_quant's random_k_quant)."""
    if kind in K_QUANTS:
        weight, expected = random_k_quant(kind, rows, in_features, seed=seed)
        return weight.parts[0].data, torch.from_numpy(expected)
    raw = random_legacy(kind, rows, in_features, seed)
    expected = gguf.quants.dequantize(raw, kind).reshape(rows, in_features)
    return torch.from_numpy(raw), torch.from_numpy(expected)


def quantized_blocks(kind: GGML, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random float32 matrix quantized by gguf to `kind`, as uint8 blocks, and gguf's float32
    dequantisation of them (test_group_quant's quantized)."""
    weight, expected = quantized(kind, ROWS, IN_FEATURES, seed=seed)
    return weight.parts[0].data, torch.from_numpy(expected)


def assert_ggufs(out: torch.Tensor, expected: torch.Tensor) -> None:
    """out is float32 and gguf's dequantisation bit for bit."""
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out.cpu(), expected, rtol=2 ** -22, atol=0)
    assert torch.equal(out.cpu(), expected)


def test_the_supported_types_are_the_kept_ones() -> None:
    """The eight block formats `--quantization gguf` keeps (float32 output for each)."""
    assert set(SUPPORTED_TYPES) == {*TYPES, *K_QUANTS}


@pytest.mark.parametrize("kind", TYPES)
def test_blocks_gguf_quantized_expand_to_ggufs_dequantisation(kind) -> None:
    """float32: a random matrix quantized by gguf, dequantized bit for bit as gguf does."""
    data, expected = quantized_blocks(kind)
    assert_ggufs(dequantize(data, kind, IN_FEATURES), expected)


@pytest.mark.parametrize("kind", [*TYPES, *K_QUANTS])
def test_random_blocks_expand_to_ggufs_dequantisation(kind) -> None:
    """float32: random codes, scales and minima under sane float16 fields, bit for bit."""
    for seed in range(3):
        data, expected = random_blocks(kind, seed=seed)
        out = dequantize(data, kind, IN_FEATURES)
        assert out.device == data.device
        assert_ggufs(out, expected)


@pytest.mark.parametrize("kind", [*TYPES, *K_QUANTS])
def test_blocks_not_at_an_aligned_offset_or_contiguous_expand_the_same(kind) -> None:
    """float32: rows sliced out of a wider buffer at an odd byte offset, and every other row
    (neither contiguous), read as the contiguous blocks; no rows give [0, in]."""
    data, expected = random_blocks(kind)
    wider = torch.zeros(ROWS, data.shape[1] + 3, dtype=torch.uint8)
    wider[:, 1:-2] = data
    assert_ggufs(dequantize(wider[:, 1:-2], kind, IN_FEATURES), expected)
    assert_ggufs(dequantize(data[::2], kind, IN_FEATURES), expected[::2])
    assert dequantize(data[:0], kind, IN_FEATURES).shape == (0, IN_FEATURES)


@pytest.mark.parametrize("kind", [*TYPES, *K_QUANTS])
def test_the_output_stays_on_the_inputs_device(kind) -> None:
    """float32 [N, in] on the blocks' device: the CPU, and the meta device (shapes only), which
    shows no step leaves the device the blocks are on."""
    data, _ = random_blocks(kind, rows=4)
    out = dequantize(data, kind, IN_FEATURES)
    assert out.device.type == "cpu" and out.dtype == torch.float32
    meta = dequantize(data.to("meta"), kind, IN_FEATURES)
    assert meta.device.type == "meta" and meta.dtype == torch.float32
    assert meta.shape == (4, IN_FEATURES)


def test_an_unsupported_type_is_refused_naming_it() -> None:
    """float32 output only for the block formats: F16 (and a format not kept) is named."""
    data = torch.zeros(2, 2 * IN_FEATURES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="F16"):
        dequantize(data, GGML.F16, IN_FEATURES)
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(data, GGML.Q2_K, IN_FEATURES)


@pytest.mark.parametrize("kind", [*TYPES, *K_QUANTS])
def test_a_wrong_row_length_is_refused_naming_the_expected_bytes(kind) -> None:
    """float32 output only for rows of in_features / weights a block * bytes a block bytes."""
    per_block, size = gguf.GGML_QUANT_SIZES[kind]
    expected_bytes = IN_FEATURES // per_block * size
    data = torch.zeros(2, expected_bytes + size, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{kind.name} .*take {expected_bytes} bytes"):
        dequantize(data, kind, IN_FEATURES)
    with pytest.raises(ValueError, match=f"blocks of {per_block}"):
        dequantize(data, kind, IN_FEATURES + 16)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(data.view(torch.int8), kind, IN_FEATURES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", [*TYPES, *K_QUANTS])
def test_on_cuda_the_blocks_expand_there_to_ggufs_dequantisation(kind) -> None:
    """float32 on the CUDA device the blocks are on, gguf's dequantisation bit for bit (each
    product and sum a separate IEEE float32 operation there too)."""
    cases = [random_blocks(kind, seed=seed) for seed in range(2)]
    if kind in TYPES:
        cases.append(quantized_blocks(kind))
    for data, expected in cases:
        out = dequantize(data.cuda(), kind, IN_FEATURES)
        assert out.device.type == "cuda"
        assert_ggufs(out, expected)


def mixed_weight(rows: int = 40, in_features: int = 512) -> GroupQuantWeight:
    """A fused projection of two types (Q4_K_M's Q4_K queries beside Q6_K values)."""
    parts = [random_k_quant(kind, rows, in_features, seed=seed)[0]
             for seed, kind in enumerate((GGML.Q4_K, GGML.Q6_K))]
    return stack_rows(parts)


@pytest.mark.parametrize("rows", [1, 40])
def test_without_the_cpp_kernels_a_product_is_the_expanded_weights_product(monkeypatch, rows) -> None:
    """float32: the path a CUDA worker takes (the blocks expanded by torch operations at each
    product), here on the CPU with the C++ library declared absent: F.linear of gguf's
    dequantisation up to float32 summation order (each part is its own product, and BLAS may
    block a product by the matrix's size and its threads: on an H100's Intel host with MKL a
    1-row product was 1.3e-4 off F.linear's), for a weight of two types; an embedding lookup
    exactly."""
    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    weight = mixed_weight()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    assert_reordered_sum(group_quant_linear(x, weight, None), x, weight.expand())
    ids = torch.tensor([[3, 0], [19, 7]])
    assert torch.equal(weight[:20].embedding(ids), weight.expand()[:20][ids])


def test_move_to_takes_the_blocks_that_model_to_does_not_see() -> None:
    """The blocks are no parameters: `model.to` leaves them; move_to puts them on the device
    (the meta device here stands for CUDA: no data is read)."""
    module = torch.nn.Linear(512, 80, bias=False)
    assign_weight(module, "weight", mixed_weight())
    model = torch.nn.Sequential(module)
    model.to("meta")
    assert all(t.device.type == "cpu" for t in module.weight.tensors())
    move_to(model, torch.device("meta"))
    assert all(t.device.type == "meta" for t in module.weight.tensors())
    assert module.weight.shape == (80, 512)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_product_is_the_expanded_weights_product_as_the_cpus_is_its_own() -> None:
    """float32 on both devices, each against the float64 product of gguf's dequantisation: the
    CUDA product (the blocks expanded there, x as it is) up to float32 sums in another order;
    the CPU's as its kernels multiply x at 40 rows (the K-quants' integer products hold x as
    16-bit fixed point where the library has AVX512-VNNI, so on such a host the two devices
    differ by that rounding: 0.04 in outputs of up to 1,757 on an H100's AMX host)."""
    weight = mixed_weight()
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1))
    on_cuda = group_quant_linear(x.cuda(), weight.to(torch.device("cuda")), None)
    assert on_cuda.device.type == "cuda"
    expanded = weight.expand()
    assert_reordered_sum(on_cuda.cpu(), x, expanded)
    on_cpu = group_quant_linear(x, weight, None)
    start = 0
    for part in weight.parts:
        end = start + part.data.shape[0]
        assert_product_close(on_cpu[:, start:end], x, expanded[start:end], part.kind)
        start = end


def test_gguf_on_cuda_is_accepted_and_runs_eagerly_without_graphs() -> None:
    """The config takes --quantization gguf on CUDA (int8 stays CPU-only) and captures no CUDA
    graphs of it (each product expands its blocks by torch operations, eagerly)."""
    config = EngineConfig(quantization="gguf", device="cuda", execution_mode="compiled")
    assert not graphs_enabled(config, "cuda")
    assert graphs_enabled(EngineConfig(device="cuda", execution_mode="compiled"), "cuda")
