"""Few-row bfloat16 products against a plain weight on the C++ library's AVX512-BF16 tiles
(spmd_cpu::bf16_linear, runtime/layers/cpu_bf16_linear.cpp) and when the layers take them
(runtime/layers/plain_bf16.py): the product against float32 arithmetic on the same bf16 values,
how the operator refuses bad arguments, and that a tied bf16 head and dequantized GGUF blocks go
through it at decode sizes. Every assertion is about bfloat16 (the operator runs no other)."""
from __future__ import annotations

import pytest
import torch
from cpu_library import CPU_HAS_BF16, needs_cpu_ops
from cpu_library import needs_bf16_tiles as needs_tiles
from spmd_runtime.runtime.layers.linear import linear
from spmd_runtime.runtime.layers.plain_bf16 import plain_bf16_linear


def operands(rows, out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    w = torch.randn(out_features, in_features, generator=generator).bfloat16()
    return x, w


def assert_product(got, x, w) -> None:
    """The float32 product of the bf16 values rounded once to bf16: within 2**-8 of itself, plus
    float32 summation-order noise (in_features x 2**-24 of the sum of |products|)."""
    exact = x.float() @ w.float().T
    noise = x.shape[1] * 2 ** -24 * (x.float().abs() @ w.float().abs().T)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert ((got.float() - exact).abs() <= 2 ** -8 * exact.abs() + noise).all()


@needs_cpu_ops
def test_the_library_says_where_it_runs() -> None:
    supported = torch.ops.spmd_cpu.bf16_linear_supported
    assert supported(576, 960) == CPU_HAS_BF16
    assert not supported(570, 960) and not supported(576, 7)


# rows: one, a pair, a lone last row, the decode batch sizes; out_features: one panel, a tail
# that overlaps the panel before, many panels; in_features: one chunk, SmolLM2's, a long one.
@needs_cpu_ops
@needs_tiles
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(8, 32), (13, 576), (1000, 576),
                                                            (100, 4096)])
def test_bf16_linear_is_the_float32_product_rounded_once(rows, out_features, in_features) -> None:
    x, w = operands(rows, out_features, in_features)
    assert_product(torch.ops.spmd_cpu.bf16_linear(x, w), x, w)


def bad_cases():
    """id -> (arguments changed from a valid x [4, 64], w [16, 64], the message expected)."""
    return {
        "float32 x": (lambda x, w: (x.float(), w), "must be bfloat16"),
        "float32 weight": (lambda x, w: (x, w.float()), "must be bfloat16"),
        "features differ": (lambda x, w: (x[:, :32].contiguous(), w), "x has 32 features"),
        "in_features not a multiple of 32": (
            lambda x, w: (x[:, :40].contiguous(), w[:, :40].contiguous()), "multiple of 32"),
        "fewer than 8 outputs": (lambda x, w: (x, w[:7].contiguous()), "out_features >= 8"),
        "strided x": (lambda x, w: (x.t().contiguous().t(), w), "contiguous"),
        "vector x": (lambda x, w: (x[0], w), "x"),
    }


@needs_cpu_ops
@needs_tiles
@pytest.mark.parametrize("name", list(bad_cases()))
def test_bf16_linear_refuses_bad_arguments_naming_them(name) -> None:
    change, match = bad_cases()[name]
    x, w = operands(4, 16, 64)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.spmd_cpu.bf16_linear(*change(x, w))


@needs_cpu_ops
@needs_tiles
def test_decode_sizes_take_the_tiles_and_longer_inputs_do_not() -> None:
    """Up to 8 rows any shape; up to 32 while 8 weight rows fit 32 KiB (bf16_linear_takes)."""
    _, w = operands(1, 64, 576)
    _, wide = operands(1, 64, 4096)
    for rows, weight, taken in [(1, w, True), (32, w, True), (33, w, False), (8, wide, True),
                                (9, wide, False)]:
        x = torch.randn(rows, weight.shape[1]).bfloat16()
        assert (plain_bf16_linear(x, weight) is not None) == taken, (rows, weight.shape)
    assert plain_bf16_linear(torch.randn(2, 576), w.float()) is None       # float32


@needs_cpu_ops
@needs_tiles
def test_a_plain_bf16_weight_in_linear_goes_through_the_tiles() -> None:
    """linear() on a plain bf16 weight (a tied head) at a decode batch: one call of the
    operator, whose output it returns with the bias added and the leading dimensions kept."""
    x, w = operands(6, 40, 64)
    bias = torch.randn(40).bfloat16()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = linear(x.view(2, 3, 64), w, bias)
    calls = [e.count for e in profile.key_averages() if e.key == "spmd_cpu::bf16_linear"]
    assert calls == [1]
    assert torch.equal(got, (torch.ops.spmd_cpu.bf16_linear(x, w) + bias).view(2, 3, 40))
