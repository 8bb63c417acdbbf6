"""One choice of an OpenAI response: its engine request, its text so far and its timings.

The n choices of one prompt share the prompt's KV blocks: the first (the leader) is submitted
at once, the others (its siblings) only once the leader's prompt is computed, which is when the
scheduler has put its full blocks in the prefix cache. The siblings then find those blocks
there and compute only what follows them.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from spmd_runtime.protocol.logprobs import TokenLogprobs
from spmd_runtime.runtime.async_client import RequestStream
from spmd_runtime.runtime.client import EngineError
from spmd_runtime.runtime.serving.metrics import ServingMetrics

# Submits a sibling's engine request; raises ValueError when the engine refuses it.
Opener = Callable[[], Awaitable[RequestStream]]


class ChoiceRun:
    def __init__(self, index: int, stream: RequestStream | None, metrics: ServingMetrics,
                 started: float, open_after: tuple[asyncio.Event, Opener] | None = None) -> None:
        """stream: the accepted engine request; or None for a sibling, with open_after = (the
        leader's prefilled event, what submits the sibling's request once it is set)."""
        self.index = index
        self.stream = stream
        self.num_tokens = 0
        self.metrics = metrics
        self.started = started       # time.perf_counter() when the HTTP request arrived
        self.finish_reason: str | None = None
        self.open_after = open_after
        # Set once this choice's prompt is computed (its first delta), or once it ended anyhow.
        self.prefilled = asyncio.Event()
        self.closed = False
        # With logprobs: the records of every token so far, and where the next token's text
        # starts in the choice's text (legacy completions' text_offset).
        self.logprobs: list[TokenLogprobs] = []
        self.text_offset = 0

    @property
    def completion_tokens(self) -> int:
        return self.num_tokens

    async def _open(self) -> RequestStream | None:
        """The engine request of a sibling, submitted once its leader's prompt is computed;
        None when the choice was closed first."""
        if self.stream is None and self.open_after is not None:
            event, opener = self.open_after
            await event.wait()
            if self.closed:
                return None
            try:
                self.stream = await opener()
            except ValueError as error:   # the leader with the same prompt was accepted
                raise EngineError(f"the engine refused choice {self.index}: {error}") from None
            if self.closed:
                self.stream.close()
        return self.stream

    async def pieces(self) -> AsyncIterator[tuple[str, list[TokenLogprobs]]]:
        """(text, the logprob records of its tokens) pieces, each with text or records (when
        asked for), until the choice finishes (finish_reason is then set).

        The engine decodes the text and cuts it at the stop strings. Leaving early (a disconnect
        cancels the consumer) aborts the engine request.
        """
        try:
            stream = await self._open()
            if stream is not None:
                async for piece in self._stream_pieces(stream):
                    yield piece
        finally:
            self.close()
        if self.finish_reason is None:
            self.finish_reason = "abort"   # closed by its owner before the engine finished it
        self.metrics.request_latency.observe(time.perf_counter() - self.started)
        self.metrics.count_finished(self.finish_reason)

    async def _stream_pieces(self, stream: RequestStream
                             ) -> AsyncIterator[tuple[str, list[TokenLogprobs]]]:
        last_token_at: float | None = None
        async for delta in stream:
            now = time.perf_counter()
            if delta.queue_time_s is not None:
                self.metrics.queue_time.observe(delta.queue_time_s)
            if delta.token_ids:
                if last_token_at is None:
                    self.metrics.time_to_first_token.observe(now - self.started)
                else:
                    gap = (now - last_token_at) / len(delta.token_ids)
                    for _ in delta.token_ids:
                        self.metrics.inter_token_latency.observe(gap)
                last_token_at = now
            self.prefilled.set()
            self.num_tokens += len(delta.token_ids)
            records = delta.logprobs or []
            self.logprobs.extend(records)
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason
            if delta.text or records:
                yield delta.text, records
            if self.finish_reason is not None:
                break

    async def collect(self) -> str:
        return "".join([piece async for piece, _ in self.pieces()])

    def close(self) -> None:
        """Abort the engine request unless it finished; a sibling not submitted yet never is."""
        self.closed = True
        self.prefilled.set()    # siblings waiting on this leader go on (and see it ended)
        if self.stream is not None:
            self.stream.close()
