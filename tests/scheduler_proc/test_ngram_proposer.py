"""NgramProposer (prompt lookup for speculative decoding): exact proposals on hand-made
sequences, a randomized cross-check against a plain-Python reference, constructor validation,
and that the module keeps the scheduler process torch-free."""
from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from spmd_runtime.scheduler_proc.ngram_proposer import NgramProposer

REPO_ROOT = Path(__file__).resolve().parents[2]


def reference_propose(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The specification, spelled out position by position: for n from max_n down to min_n,
    the latest start i with i + n <= len - 1 whose n tokens equal the last n; the first n
    that matches gives the (up to k) tokens after that occurrence."""
    tokens = list(token_ids)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        pattern = tokens[-n:]
        for i in range(len(tokens) - 1 - n, -1, -1):
            if tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []


@pytest.mark.parametrize(("tokens", "k", "max_tokens", "expected"), [
    # 4-gram [1, 2, 3, 4] at 0 beats the later 1-gram [4] at 7 (and 2-gram [3, 4] at 6).
    ([1, 2, 3, 4, 5, 6, 3, 4, 9, 1, 2, 3, 4], 3, None, [5, 6, 3]),
    # the latest occurrence of [7, 8] wins over the earlier one.
    ([7, 8, 1, 7, 8, 2, 7, 8], 1, None, [2]),
    ([7, 8, 1, 1, 7, 8, 2, 2, 7, 8], 2, None, [2, 2]),
    # truncated: the match ends one token before the suffix, so only one token follows it.
    ([5, 6, 5, 6, 5], 4, None, [6, 5]),
    ([1, 2, 3, 9, 1, 2, 3], 5, None, [9, 1, 2, 3]),
    # max_tokens limits k below num_speculative_tokens, and 0 or less proposes nothing.
    ([1, 2, 3, 4, 5, 1, 2], 5, 2, [3, 4]),
    ([1, 2, 3, 4, 5, 1, 2], 2, 10, [3, 4]),
    ([1, 2, 3, 4, 5, 1, 2], 5, 0, []),
    ([1, 2, 3, 4, 5, 1, 2], 5, -1, []),
    # no earlier occurrence of the last token at all.
    ([1, 2, 3, 4], 3, None, []),
    # shorter than any pattern plus one token: nothing to look up.
    ([], 3, None, []),
    ([1], 3, None, []),
    ([1, 1], 3, None, [1]),
    # a self-overlapping repeat: the 4-gram [1, 2, 1, 2] occurs at 0 (overlapping the suffix).
    ([1, 2, 1, 2, 1, 2], 3, None, [1, 2]),
    ([3, 3, 3, 3, 3], 3, None, [3]),
])
def test_exact_proposals(tokens: list[int], k: int, max_tokens: int | None,
                         expected: list[int]) -> None:
    assert NgramProposer(k).propose(tokens, max_tokens) == expected


def test_longest_n_wins_over_a_later_shorter_match() -> None:
    tokens = [9, 1, 2, 3, 10, 11, 5, 3, 20, 6, 2, 3, 30, 1, 2, 3]
    assert NgramProposer(2, max_n=3).propose(tokens) == [10, 11]
    assert NgramProposer(2, max_n=2).propose(tokens) == [30, 1]
    assert NgramProposer(2, max_n=1).propose(tokens) == [30, 1]


def test_min_n_rejects_shorter_matches() -> None:
    tokens = [1, 2, 7, 3, 2]
    assert NgramProposer(2, min_n=1).propose(tokens) == [7, 3]
    assert NgramProposer(2, min_n=2).propose(tokens) == []


def test_sequence_shorter_than_max_n_uses_the_lengths_that_fit() -> None:
    assert NgramProposer(3, min_n=1, max_n=8).propose([4, 5, 4]) == [5, 4]
    assert NgramProposer(3, min_n=3, max_n=8).propose([4, 5, 4]) == []


def test_accepts_tuples_and_arrays_and_returns_python_ints() -> None:
    proposer = NgramProposer(3)
    tokens = [1, 2, 3, 4, 1, 2]
    for given in (tokens, tuple(tokens), np.array(tokens, dtype=np.int32)):
        proposal = proposer.propose(given)
        assert proposal == [3, 4, 1]
        assert all(type(token) is int for token in proposal)


def test_is_stateless_across_calls() -> None:
    proposer = NgramProposer(2)
    first = [1, 2, 3, 1, 2]
    assert proposer.propose(first) == [3, 1]
    assert proposer.propose([8, 9, 8]) == [9, 8]
    assert proposer.propose(first) == [3, 1]


def test_matches_the_reference_on_random_sequences() -> None:
    rng = random.Random(20240611)
    for _ in range(400):
        alphabet = rng.randint(1, 6)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 60))]
        k = rng.randint(1, 8)
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        max_tokens = rng.choice([None, 0, 1, 3, 10])
        limit = k if max_tokens is None else min(k, max_tokens)
        expected = reference_propose(tokens, limit, min_n, max_n)
        got = NgramProposer(k, min_n, max_n).propose(tokens, max_tokens)
        assert got == expected, (tokens, k, min_n, max_n, max_tokens)


@pytest.mark.parametrize(("args", "message"), [
    ((0,), "num_speculative_tokens must be at least 1"),
    ((-2,), "num_speculative_tokens must be at least 1"),
    ((3, 0, 4), "min_n must be at least 1"),
    ((3, 3, 2), r"max_n \(2\) must be at least min_n \(3\)"),
])
def test_constructor_validation(args: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)


def test_importing_keeps_the_scheduler_torch_free() -> None:
    code = ("import sys; import spmd_runtime.scheduler_proc.ngram_proposer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
