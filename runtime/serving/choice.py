"""One choice of an OpenAI response: its engine request, its text so far and its timings."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from spmd_runtime.protocol.logprobs import TokenLogprobs
from spmd_runtime.runtime.async_client import RequestStream
from spmd_runtime.runtime.serving.metrics import ServingMetrics


class ChoiceRun:
    def __init__(self, index: int, stream: RequestStream, metrics: ServingMetrics,
                 started: float) -> None:
        self.index = index
        self.stream = stream
        self.num_tokens = 0
        self.metrics = metrics
        self.started = started       # time.perf_counter() when the HTTP request arrived
        self.finish_reason: str | None = None
        # With logprobs: the records of every token so far, and where the next token's text
        # starts in the choice's text (legacy completions' text_offset).
        self.logprobs: list[TokenLogprobs] = []
        self.text_offset = 0

    @property
    def completion_tokens(self) -> int:
        return self.num_tokens

    async def pieces(self) -> AsyncIterator[tuple[str, list[TokenLogprobs]]]:
        """(text, the logprob records of its tokens) pieces, each with text or records (when
        asked for), until the choice finishes (finish_reason is then set).

        The engine decodes the text and cuts it at the stop strings. Leaving early (a disconnect
        cancels the consumer) aborts the engine request.
        """
        last_token_at: float | None = None
        try:
            async for delta in self.stream:
                now = time.perf_counter()
                if delta.token_ids:
                    if last_token_at is None:
                        self.metrics.time_to_first_token.observe(now - self.started)
                    else:
                        gap = (now - last_token_at) / len(delta.token_ids)
                        for _ in delta.token_ids:
                            self.metrics.inter_token_latency.observe(gap)
                    last_token_at = now
                self.num_tokens += len(delta.token_ids)
                piece, records = delta.text, delta.logprobs or []
                self.logprobs.extend(records)
                if delta.finish_reason is not None:
                    self.finish_reason = delta.finish_reason
                if piece or records:
                    yield piece, records
                if self.finish_reason is not None:
                    break
        finally:
            self.stream.close()
        if self.finish_reason is None:
            self.finish_reason = "abort"   # closed by its owner before the engine finished it
        self.metrics.request_latency.observe(time.perf_counter() - self.started)
        self.metrics.finished.labels(self.finish_reason).inc()

    async def collect(self) -> str:
        return "".join([piece async for piece, _ in self.pieces()])

    def close(self) -> None:
        self.stream.close()
