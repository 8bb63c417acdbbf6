"""N-gram "prompt lookup" proposals for speculative decoding.

Prompt lookup guesses a request's next tokens without a draft model: it takes the last n
tokens of the sequence (prompt + generated tokens so far), looks for an earlier place where
the same n tokens occur, and proposes the tokens that followed them there. The target model
then verifies the proposal in one forward pass and keeps the longest correct prefix, so a
wrong guess only costs the extra positions in that pass, while a right one yields several
tokens per step. It pays off whenever the output copies from the context: code edits,
summaries and quotations of a given document, retrieval answers, repeated boilerplate.

The longest n that matches wins, because a longer shared context is a stronger sign that the
continuation repeats too. Among the occurrences of that pattern the LATEST one wins: the most
recent context is the likeliest to repeat (a model editing or summarising a text walks through
it in order, so the part it is copying now is the one right behind the previous match, and the
tokens it generated itself recently reflect its current phrasing best).

This runs in the scheduler process for every decoding request at every step, so it uses
numpy (never torch): one vectorised comparison of the whole sequence against its last token
finds the candidate match ends, and each further pattern position only filters the (few)
surviving candidates.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes up to `num_speculative_tokens` draft tokens per call by n-gram prompt lookup,
    trying pattern lengths from `max_n` down to `min_n`. Stateless: the same input always
    gives the same output, so one instance can serve every request."""

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1 (got "
                             f"{num_speculative_tokens}); pass a positive number of draft tokens")
        if min_n < 1:
            raise ValueError(f"min_n must be at least 1 (got {min_n}); the shortest pattern "
                             f"needs one token")
        if max_n < min_n:
            raise ValueError(f"max_n ({max_n}) must be at least min_n ({min_n}); raise max_n "
                             f"or lower min_n")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching
        suffix pattern (n from max_n down to min_n), at most min(num_speculative_tokens,
        max_tokens) of them and fewer when that occurrence is near the end; [] when no
        pattern of at least min_n tokens occurs earlier or the limit is 0."""
        k = self.num_speculative_tokens if max_tokens is None else min(
            self.num_speculative_tokens, max_tokens)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        seq = _as_int64_array(token_ids)
        end = self._latest_match_end(seq)
        if end < 0:
            return []
        return seq[end + 1:end + 1 + k].tolist()

    def _latest_match_end(self, seq: np.ndarray) -> int:
        """The index of the last token of the chosen earlier occurrence, or -1 if none.

        `ends` holds every j <= len-2 (so the continuation seq[j+1] exists and the match is
        not the suffix itself) where seq[j-m] == seq[len-1-m] for all m below the current
        pattern length n; after the step for n, its last element is the latest n-gram match.
        Growing n only removes candidates, so the loop stops as soon as none is left."""
        last = len(seq) - 1
        ends = np.flatnonzero(seq[:last] == seq[last])
        best = -1
        for n in range(1, min(self.max_n, last) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[seq[ends - (n - 1)] == seq[last - (n - 1)]]
            if ends.size == 0:
                break
            if n >= self.min_n:
                best = int(ends[-1])
        return best


def _as_int64_array(token_ids: Sequence[int]) -> np.ndarray:
    """token_ids as an int64 array. Converting the sequence is most of a call's cost, and for
    a Python list np.fromiter with a known count is about a fifth faster than np.asarray; an
    array is only cast (no copy when it already is int64)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype(np.int64, copy=False)
    return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
