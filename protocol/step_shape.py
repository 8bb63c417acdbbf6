"""The two kinds of step a bucketed engine runs, and the shape a step is padded to.

Every step of a bucketed engine is a prompt step (prefill chunks) or a decode step (one new
token per sequence). Its shape is the bucket it pads to: a batch size and a length, the chunk
length of a prompt step or the context length of a decode step. The scheduler picks it, the
plan carries it (StepPlan.bucket), and every rank pads, compiles and captures by it.
"""
from __future__ import annotations

import enum
from typing import NamedTuple


class Phase(enum.StrEnum):
    PROMPT = "prompt"
    DECODE = "decode"

    # Hashed as its value, as a str is (Enum's own hash is of the name, in Python): equal to
    # "prompt", so hashed alike, and cheap where the scheduler looks buckets up per request.
    __hash__ = str.__hash__

    @classmethod
    def of(cls, num_tokens_left: int) -> Phase:
        """A request with one token left to compute decodes; any other is (still) prefilling."""
        return cls.DECODE if num_tokens_left == 1 else cls.PROMPT

    @property
    def other(self) -> Phase:
        return Phase.DECODE if self is Phase.PROMPT else Phase.PROMPT

    def tokens(self, batch_size: int, length: int) -> int:
        """Tokens a step of this phase and shape computes: every position of every sequence
        for a prompt, one new token per sequence for a decode. It is also what a compiled
        graph's shape depends on."""
        return batch_size * length if self is Phase.PROMPT else batch_size

    def batch_size(self, num_seqs: int, num_tokens: int) -> int:
        """The batch dimension of a step of this phase holding `num_seqs` sequences and
        `num_tokens` tokens: the sequences of a prompt step; the rows of a decode step, one a
        token (a request verifying k speculative proposals takes k + 1)."""
        return num_seqs if self is Phase.PROMPT else num_tokens


# The members as module names: Phase.DECODE is an attribute lookup on the enum class, ~5x a
# global's; the scheduler's per-request path uses these.
PROMPT, DECODE = Phase.PROMPT, Phase.DECODE


class StepShape(NamedTuple):
    """The bucket a step is padded to."""

    phase: Phase
    batch_size: int
    length: int       # chunk length (prompt) or context length in tokens (decode)

    @property
    def num_tokens(self) -> int:
        return self.phase.tokens(self.batch_size, self.length)
