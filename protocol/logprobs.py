"""Log-probabilities on the wire: one compact record per token, and a step's per request."""
from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One position: token_ids[0] is the token chosen there (sampled, or the prompt's), with its
    log-probability logprobs[0]; then the top-k tokens, likeliest first, with theirs."""

    token_ids: list[int]
    logprobs: list[float]

    @property
    def token_id(self) -> int:
        return self.token_ids[0]

    @property
    def logprob(self) -> float:
        return self.logprobs[0]

    @property
    def top(self) -> list[tuple[int, float]]:
        """The top-k as (token id, log-probability), likeliest first."""
        return list(zip(self.token_ids[1:], self.logprobs[1:], strict=True))


class StepLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step computed for one request: its sampled token's record, and records of
    prompt tokens prompt_start, prompt_start + 1, ... (a prefill chunk's positions); for a
    request that verified proposals, the record of each token it emitted, in order."""

    request_id: int
    sampled: TokenLogprobs | None = None
    prompt_start: int = 0
    prompt: list[TokenLogprobs] = []
    verified: list[TokenLogprobs] = []
