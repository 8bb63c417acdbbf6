"""The LM head of `--quantization int8` over a GGUF file (runtime/layers/cpu_int8_head.h,
int8_blocks.Int8BlocksHead): 8-bit logits with a proven bound of their error, the logits that
could be a row's largest re-scored exactly, and the greedy head that gives the first largest
without writing the logits. The exact reference is float64: the blocks decoded here in numpy
(scale, minimum and codes, no rounding), times the rows widened exactly."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from cpu_library import needs_int8_blocks
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.runtime import LLM, SamplingParams
from spmd_runtime.runtime.layers.int8_blocks import INT8_BLOCK_TYPES, Int8BlocksHead
from spmd_runtime.runtime.layers.quantization import quantize_linear_weights
from test_int8_blocks import blocks_of, gguf_model, k_quant_blocks


def bounds_of(blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
    return torch.ops.spmd_cpu.gguf_int8_head_bounds(blocks, kind, in_features)


def exact_weights(blocks: torch.Tensor, tensor_type: GGML, in_features: int) -> np.ndarray:
    """float64 [N, in]: each block's a (u - zero) + c from its bytes, exactly."""
    raw = blocks.numpy()
    size = {GGML.Q4_0: 18, GGML.Q4_1: 20, GGML.Q5_0: 22, GGML.Q5_1: 24, GGML.Q8_0: 34}[tensor_type]
    b = raw.reshape(raw.shape[0], in_features // 32, size)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)[..., None]
    if tensor_type == GGML.Q8_0:
        return (d * b[..., 2:].view(np.int8)).reshape(raw.shape[0], in_features)
    with_min = tensor_type in (GGML.Q4_1, GGML.Q5_1)
    five = tensor_type in (GGML.Q5_0, GGML.Q5_1)
    at = 4 if with_min else 2
    c = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)[..., None] if with_min \
        else 0.0
    codes = b[..., at + (4 if five else 0):]
    u = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).astype(np.int64)
    if five:
        high = b[..., at:at + 4].copy().view(np.uint32)
        u |= ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
    zero = 0 if with_min else (16 if five else 8)
    return (d * (u - zero) + c).reshape(raw.shape[0], in_features)


def steps_of(x: torch.Tensor) -> torch.Tensor:
    """float64 [M, in / 32]: each block's 8-bit step, max |x| / 127 in float32 (as the kernel)."""
    return (x.float().abs().view(x.shape[0], -1, 32).amax(-1) / 127.0).double()


def rows_with_outliers(rows: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g) * torch.logspace(-1, 0.5, in_features)
    x[:, torch.randint(0, in_features, (3,), generator=g)] *= 20.0    # a few large channels
    return x


def case(tensor_type: GGML, dtype: torch.dtype, rows: int, features: int, in_features: int = 96,
         seed: int = 0):
    blocks = blocks_of(tensor_type, features, in_features, seed=seed)
    x = rows_with_outliers(rows, in_features, seed + 1).to(dtype)
    exact = x.double() @ torch.from_numpy(exact_weights(blocks, tensor_type, in_features)).t()
    return blocks, x, exact


@needs_int8_blocks
@pytest.mark.parametrize("tensor_type", INT8_BLOCK_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_holds_for_every_8bit_logit(tensor_type, dtype) -> None:
    """float64 (the bound against exact logits): every 8-bit logit lies within B_v = sum_b
    step_b m_vb of the exact one, the table's last N floats are each feature's largest m_vb, and
    the bound is not vacuous (the largest error reaches a tenth of it)."""
    in_features, features = 160, 96
    blocks, x, exact = case(tensor_type, dtype, 40, features, in_features)
    table = bounds_of(blocks, int(tensor_type), in_features).double()
    m = table[:features * 5].view(features, 5)
    assert torch.equal(table[features * 5:], m.amax(1))
    eight_bit = torch.ops.spmd_cpu.gguf_int8_linear(x.float(), blocks, int(tensor_type),
                                                    in_features).double()
    bound = steps_of(x) @ m.t()
    error = (eight_bit - exact).abs()
    assert (error <= bound).all()
    assert (error / bound).max() >= 0.1


@needs_int8_blocks
@pytest.mark.parametrize("tensor_type", INT8_BLOCK_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,features", [(1, 100), (7, 64), (64, 200)])
def test_the_head_rescores_every_logit_that_could_be_the_largest(tensor_type, dtype, rows,
                                                                features) -> None:
    """float32 logits against float64: where the bound leaves a feature a chance of being its
    row's largest (L_v + B_v >= max(L_u - B_u)) its logit is the exact one rounded once; every
    other logit is the 8-bit product's; so the first largest is the exact logits'."""
    blocks, x, exact = case(tensor_type, dtype, rows, features, seed=rows)
    kind = int(tensor_type)
    table = bounds_of(blocks, kind, 96)
    head = torch.ops.spmd_cpu.gguf_int8_head(x, blocks, kind, 96, table)
    eight_bit = torch.ops.spmd_cpu.gguf_int8_linear(x.float(), blocks, kind, 96)
    bound = steps_of(x) @ table[:features * 3].view(features, 3).double().t()
    chance = eight_bit.double() + bound >= (eight_bit.double() - bound).amax(1, keepdim=True)
    rounded = exact.float()
    assert head.dtype == torch.float32 and head.shape == (rows, features)
    assert torch.equal(head[chance], rounded[chance])
    rescored = head != eight_bit
    assert torch.equal(head[rescored], rounded[rescored])
    assert torch.equal(head.argmax(1), rounded.argmax(1))


@needs_int8_blocks
def test_near_ties_the_8bit_logits_misorder_go_to_the_exact_largest() -> None:
    """float64: 24 rows of one Q8_0 table that differ by one code step give every row of x
    (near one direction, which those rows lead) logits closer than the 8-bit error; the 8-bit
    argmax picks wrongly in some rows, the head and the greedy head never. With the 24 rows
    identical every logit ties and both give the first index."""
    g = torch.Generator().manual_seed(5)
    direction = rows_with_outliers(1, 128, 5)
    x = direction + 0.3 * torch.randn(64, 128, generator=g)
    base = gguf.quants.quantize(direction.numpy() * 0.02, GGML.Q8_0)
    same = np.repeat(base, 24, axis=0)
    table = same.copy()
    codes = table[:, 2:34].view(np.int8)                       # block 0's codes of each row
    for row in range(1, 24):
        codes[row, int(torch.randint(0, 32, (1,), generator=g))] += 1 if row % 2 else -1
    rest = gguf.quants.quantize(torch.randn(40, 128, generator=g).numpy() * 0.001, GGML.Q8_0)
    kind = int(GGML.Q8_0)
    for rows, tied in ((table, False), (same, True)):
        blocks = torch.from_numpy(np.concatenate([rows, rest]))
        exact = (x.double() @ torch.from_numpy(exact_weights(blocks, GGML.Q8_0, 128)).t()).float()
        bounds = bounds_of(blocks, kind, 128)
        eight_bit = torch.ops.spmd_cpu.gguf_int8_linear(x, blocks, kind, 128)
        head = torch.ops.spmd_cpu.gguf_int8_head(x, blocks, kind, 128, bounds)
        greedy = torch.ops.spmd_cpu.gguf_int8_greedy_head(x, blocks, kind, 128, bounds)
        assert (exact.argmax(1) < 24).all()
        if tied:
            assert not greedy.any() and not head.argmax(1).any()
        else:
            assert (eight_bit.argmax(1) != exact.argmax(1)).any()
            assert torch.equal(head.argmax(1), exact.argmax(1))
            assert torch.equal(greedy, exact.argmax(1))


@needs_int8_blocks
@pytest.mark.parametrize("tensor_type", [GGML.Q4_0, GGML.Q4_1, GGML.Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,features", [(1, 40), (6, 1000), (33, 100), (70, 320)])
def test_the_greedy_head_gives_the_heads_first_largest_logit(tensor_type, dtype, rows,
                                                             features) -> None:
    """int64 tokens: the greedy head's token is greedy_tokens of the head's logits and the
    exact logits' argmax, at tile tails, partial panels and panels split between tasks."""
    blocks, x, exact = case(tensor_type, dtype, rows, features, seed=features)
    kind = int(tensor_type)
    table = bounds_of(blocks, kind, 96)
    tokens = torch.ops.spmd_cpu.gguf_int8_greedy_head(x, blocks, kind, 96, table)
    logits = torch.ops.spmd_cpu.gguf_int8_head(x, blocks, kind, 96, table)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, torch.ops.spmd_cpu.greedy_tokens(logits))
    assert torch.equal(tokens, exact.float().argmax(1))


@needs_int8_blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,features", [(16, 1), (16, 6), (17, 7), (31, 100), (32, 601),
                                           (48, 13), (67, 250)])
def test_the_q8_0_greedy_head_of_a_decode_batch_gives_the_exact_first_largest(dtype, rows,
                                                                              features) -> None:
    """int64 tokens: from 16 rows a Q8_0 greedy head takes the lane tiles (16 rows a register,
    6 features a tile, the file's blocks read in place); its token is the exact logits' argmax
    at partial row registers, partial tiles and tasks' edges, also with K = 576 (SmolLM2's),
    and equal exact logits (two identical rows of weights, in different tiles and tasks, the
    largest for most rows) give the lower feature, as argmax does."""
    blocks, x, exact = case(GGML.Q8_0, dtype, rows, features, seed=rows + features)
    kind = int(GGML.Q8_0)
    tokens = torch.ops.spmd_cpu.gguf_int8_greedy_head(x, blocks, kind, 96,
                                                      bounds_of(blocks, kind, 96))
    assert torch.equal(tokens, exact.float().argmax(1))
    # Inputs all positive: every block's codes sum to ~32 x 100, the term the shift of the
    # weights' codes to unsigned bytes takes off the integer sums.
    shifted = (x.float().abs() + 1).to(dtype)
    exact_shifted = shifted.double() @ torch.from_numpy(exact_weights(blocks, GGML.Q8_0, 96)).t()
    tokens = torch.ops.spmd_cpu.gguf_int8_greedy_head(shifted, blocks, kind, 96,
                                                      bounds_of(blocks, kind, 96))
    assert torch.equal(tokens, exact_shifted.float().argmax(1))
    wide = blocks_of(GGML.Q8_0, features, 576, seed=features)
    x_wide = rows_with_outliers(rows, 576, rows).to(dtype)
    exact_wide = (x_wide.double() @ torch.from_numpy(exact_weights(wide, GGML.Q8_0, 576)).t())
    tokens = torch.ops.spmd_cpu.gguf_int8_greedy_head(x_wide, wide, kind, 576,
                                                      bounds_of(wide, kind, 576))
    assert torch.equal(tokens, exact_wide.float().argmax(1))
    if features >= 13:
        common = rows_with_outliers(1, 96, 99)
        x_tied = (x.float() + 4 * common).to(dtype)
        tied = blocks.clone()
        low, high = 3, features - 2
        tied[low] = tied[high] = torch.from_numpy(
            gguf.quants.quantize((3 * common.sign()).numpy(), GGML.Q8_0)[0])
        exact_tied = (x_tied.double() @ torch.from_numpy(exact_weights(tied, GGML.Q8_0, 96)).t())
        first = exact_tied.float().argmax(1)
        assert (first == low).sum() >= rows // 2
        tokens = torch.ops.spmd_cpu.gguf_int8_greedy_head(x_tied, tied, kind, 96,
                                                          bounds_of(tied, kind, 96))
        assert torch.equal(tokens, first)


@needs_int8_blocks
@pytest.mark.parametrize("rows", [5, 20])
def test_rows_that_are_not_finite_are_rescored_whole(rows) -> None:
    """float32: a row holding inf or NaN gets exact logits throughout (no 8-bit bound holds for
    it) and the greedy head picks from them as greedy_tokens does; a zero row and the finite
    rows are unaffected (5 rows: the panels; 20: the Q8_0 lane tiles)."""
    blocks, x, exact = case(GGML.Q8_0, torch.float32, rows, 100)
    x[1, 3], x[2, 7], x[3] = float("inf"), float("nan"), 0.0
    kind = int(GGML.Q8_0)
    table = bounds_of(blocks, kind, 96)
    logits = torch.ops.spmd_cpu.gguf_int8_head(x, blocks, kind, 96, table)
    tokens = torch.ops.spmd_cpu.gguf_int8_greedy_head(x, blocks, kind, 96, table)
    assert torch.equal(tokens, torch.ops.spmd_cpu.greedy_tokens(logits))
    for row in [0] + list(range(4, rows)):
        assert tokens[row] == exact[row].float().argmax()
    assert not logits[3].any() and tokens[3] == 0
    assert torch.isnan(logits[2]).all() and tokens[2] == 0


@needs_int8_blocks
def test_the_head_ops_refuse_bad_inputs_naming_them() -> None:
    blocks = blocks_of(GGML.Q8_0, 64, 96)
    kind, x = int(GGML.Q8_0), torch.randn(3, 96)
    table = bounds_of(blocks, kind, 96)
    for op in (torch.ops.spmd_cpu.gguf_int8_head, torch.ops.spmd_cpu.gguf_int8_greedy_head):
        for args, match in [((x, blocks, kind, 96, table[:-1]), "bounds must be"),
                            ((x, blocks, kind, 96, table.double()), "bounds must be"),
                            ((x, blocks, kind, 96, table.view(64, 4)), "bounds must be 1-D"),
                            ((x[:, :64].contiguous(), blocks, kind, 96, table), "x has 64"),
                            ((x.double(), blocks, kind, 96, table), "float32 or bfloat16"),
                            ((x, blocks, int(GGML.Q4_1), 96, table), "bytes a row")]:
            with pytest.raises(RuntimeError, match=match):
                op(*args)
    with pytest.raises(RuntimeError, match="not a block of 32"):
        bounds_of(k_quant_blocks(), int(GGML.Q4_K), 256)
    with pytest.raises(RuntimeError, match="bytes a row"):
        bounds_of(blocks, kind, 64)


@needs_int8_blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_gguf_model_gives_greedy_tokens_without_logits(dtype) -> None:
    """int64 tokens against the model's float32 logits: an int8 model over GGUF blocks answers
    greedy_tokens from its head, the first largest of compute_logits; a model without such a
    head answers None (its runner takes the logits)."""
    model, config = gguf_model(GGML.Q4_1, dtype)
    assert model.greedy_tokens(torch.randn(4, config.hidden_size).to(dtype)) is None
    quantize_linear_weights(model, "int8")
    assert isinstance(model.lm_head, Int8BlocksHead)
    hidden = rows_with_outliers(9, config.hidden_size, 3).to(dtype)
    tokens = model.greedy_tokens(hidden)
    assert tokens is not None and torch.equal(tokens, model.compute_logits(hidden).argmax(-1))


@needs_int8_blocks
@pytest.mark.timeout(300)
def test_the_engine_samples_greedy_tokens_from_the_int8_head_as_from_its_logits() -> None:
    """bfloat16 with int8 products (SmolLM2's Q4_1/Q8_0 file): greedy requests without
    logprobs take their tokens from the greedy head, requests asking for logprobs from the
    head's logits; both give the same tokens, and a temperature request still samples."""
    prompts = ["The capital of France is", "List three colours:", "def fibonacci(n):",
               "Water boils at"]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM("smollm2", dtype="bfloat16", quantization="int8", num_kv_blocks=128,
             max_model_len=256) as llm:
        fast = llm.generate(prompts, plain)
        with_logits = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                           ignore_eos=True, logprobs=0))
        sampled = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.8,
                                                           seed=1, ignore_eos=True))
    assert [o.token_ids for o in fast] == [o.token_ids for o in with_logits]
    assert all(o.logprobs is None for o in fast)
    assert len(sampled[0].token_ids) == 4
