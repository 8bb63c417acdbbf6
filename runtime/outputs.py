"""Results handed back to users."""
from __future__ import annotations

from dataclasses import dataclass, field

from spmd_runtime.protocol.logprobs import TokenLogprobs
from spmd_runtime.protocol.messages import RequestDelta


@dataclass
class RequestOutput:
    """One request's output so far. With SamplingParams.logprobs, `logprobs` holds one record
    per token of token_ids (record.token_id, record.logprob, record.top: the top-k as (token id,
    logprob) pairs); with prompt_logprobs, `prompt_logprobs` one per prompt token, None first."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        """Append a delta of this request."""
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
