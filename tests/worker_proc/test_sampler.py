"""Token sampling: greedy, seeded reproducibility independent of the batch, top-k / top-p limits."""
from __future__ import annotations

import pytest
import torch
from cpu_library import needs_cpu_ops
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.worker_proc.sampler import _filtered_probs, greedy_tokens, sample

VOCAB = 300


def logits_batch(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax() -> None:
    logits = logits_batch(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert sample(logits, params, [5] * 6, gen()) == logits.argmax(-1).tolist()


def test_greedy_picks_what_argmax_picks_on_ties_nan_and_infinities() -> None:
    """The CPU's max reduction stands in for argmax: the first of equal maxima, the first NaN,
    index 0 of a row of -inf."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (16, 5000), generator=g).float()     # ties everywhere
    logits[3, 17] = logits[3, 4000] = float("nan")
    logits[5] = float("-inf")
    logits[6, 2500] = float("inf")
    logits[6, 4999] = float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(logits)[[3, 5, 6]].tolist() == [17, 0, 2500]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_in_either_storage_dtype(dtype) -> None:
    """float32 and bfloat16 logits (exact: a comparison, no arithmetic), rows of a length that
    leaves a partial register, with the maximum, a tie or a NaN in the first, a middle and the
    last (partial) 16 columns, and logits as a view with a row stride."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 1003, generator=g).to(dtype)
    for row, column in enumerate([0, 15, 16, 500, 991, 1002]):
        logits[row, column] = 50.0
        logits[6 + row, column] = float("nan")
    logits[3, 700] = 50.0          # a tie after the first maximum
    logits[9, 1000] = float("nan")  # a second NaN after the first
    expected = logits.float().argmax(-1)
    assert torch.equal(greedy_tokens(logits), expected)
    wide = torch.zeros(12, 1100, dtype=dtype)
    wide[:, :1003] = logits
    assert torch.equal(greedy_tokens(wide[:, :1003]), expected)


@needs_cpu_ops
@pytest.mark.parametrize(("logits", "match"), [
    (torch.zeros(4, 8, dtype=torch.float16), "float32 or bfloat16"),
    (torch.zeros(3, 4, 5), "dimensions"),
    (torch.zeros(8, 4).t(), "column stride"),
    (torch.zeros(4, 0), "no columns")])
def test_the_greedy_kernel_refuses_bad_logits_naming_them(logits, match) -> None:
    with pytest.raises(RuntimeError, match=match):
        torch.ops.spmd_cpu.greedy_tokens(logits)


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = logits_batch(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)]
    tokens = sample(logits, params, [3, 4, 5, 6], gen())
    argmax = logits.argmax(-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    assert all(0 <= t < VOCAB for t in tokens)


def test_seeded_sampling_is_reproducible_for_same_seed_and_length() -> None:
    logits = logits_batch(1)
    params = [SamplingParams(temperature=1.0, seed=7)]
    first = [sample(logits, params, [n], gen(n * 11)) for n in range(10, 40)]
    again = [sample(logits, params, [n], gen(999)) for n in range(10, 40)]
    assert first == again, "a seeded row must not depend on the shared generator"
    # ... but it does depend on the position, otherwise every step would repeat one token.
    assert len({t[0] for t in first}) > 5


def test_seeded_sampling_is_independent_of_other_rows() -> None:
    target = logits_batch(1, seed=5)[0]
    params = SamplingParams(temperature=0.8, seed=7)
    alone = [sample(target[None], [params], [n], gen())[0] for n in range(20, 40)]
    for batch_size, position in ((3, 0), (6, 4), (8, 7)):
        others = logits_batch(batch_size, seed=batch_size)
        mixed = []
        for n in range(20, 40):
            logits = others.clone()
            logits[position] = target
            row_params = [SamplingParams(temperature=1.0, seed=s) if s % 2 else
                          SamplingParams(temperature=0.5) for s in range(batch_size)]
            row_params[position] = params
            lengths = [n + 3 * i for i in range(batch_size)]
            lengths[position] = n
            mixed.append(sample(logits, row_params, lengths, gen(n))[position])
        assert mixed == alone, f"batch of {batch_size}, row {position}"


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)     # uniform: two seeds agreeing on 20 draws is ~impossible
    a = [sample(logits, [SamplingParams(seed=1)], [n], gen())[0] for n in range(20)]
    b = [sample(logits, [SamplingParams(seed=2)], [n], gen())[0] for n in range(20)]
    assert a != b


def test_unseeded_sampling_uses_the_shared_generator() -> None:
    logits = torch.zeros(1, VOCAB)
    params = [SamplingParams(temperature=1.0)]
    a = [sample(logits, params, [5], g)[0] for g in [gen(3)] for _ in range(20)]
    b = [sample(logits, params, [5], g)[0] for g in [gen(3)] for _ in range(20)]
    assert a == b and len(set(a)) > 1


@pytest.mark.parametrize("temperature", [0.7, 1.0, 5.0])
def test_top_k_1_equals_greedy(temperature: float) -> None:
    logits = logits_batch(8, seed=2)
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(8)]
    for n in range(5):
        assert sample(logits, params, [n] * 8, gen(n)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 5.0])
def test_tiny_top_p_equals_greedy(temperature: float) -> None:
    logits = logits_batch(8, seed=3)
    params = [SamplingParams(temperature=temperature, top_p=1e-6) for _ in range(8)]
    for n in range(5):
        assert sample(logits, params, [n] * 8, gen(n)) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = logits_batch(1, seed=4)[0]
    probs = _filtered_probs(logits, SamplingParams(temperature=1.0, top_k=5))
    assert set(torch.nonzero(probs).flatten().tolist()) == set(logits.topk(5).indices.tolist())
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    draws = {sample(logits[None], [SamplingParams(top_k=5, seed=s)], [0], gen())[0]
             for s in range(200)}
    assert draws <= set(logits.topk(5).indices.tolist()) and len(draws) > 1


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = _filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.nonzero(probs).flatten().tolist() == [0, 1]
    probs = _filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert torch.nonzero(probs).flatten().tolist() == [0, 1, 2]


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    params = [SamplingParams(temperature=1.0)]
    g = gen(0)
    counts = torch.bincount(torch.tensor([sample(logits, params, [0], g)[0]
                                          for _ in range(3000)]), minlength=3)
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04), freq
