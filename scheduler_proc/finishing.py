"""When a request ends, and why: the one place that decides it.

A request finishes on a token it samples (EOS unless ignored, one of its stop tokens: "stop"),
on its length (max_tokens, or the context limit: "length"), on its text (a stop string the
detokenizer finds in what it streams: "stop") or on its deadline (timeout_s: "timeout"). A
client's abort and an engine failure end requests from outside ("abort", "error").
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable

from spmd_runtime.scheduler_proc.request import FinishReason, Request


class FinishRules:
    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # (deadline, request id, arrival) of requests with a timeout, soonest first.
        self._deadlines: list[tuple[float, int, int]] = []

    def after_token(self, request: Request, token: int) -> FinishReason | None:
        """Whether the token the request just sampled (already appended) ends it."""
        params = request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def after_text(reached_stop_string: bool) -> FinishReason | None:
        """Whether the text streamed so far ends the request: it reached a stop string."""
        return FinishReason.STOP if reached_stop_string else None

    def add_deadline(self, request: Request, timeout_s: float) -> None:
        heapq.heappush(self._deadlines, (time.monotonic() + timeout_s, request.request_id,
                                         request.arrival_seq))

    def past_deadline(self, lookup: Callable[[int], Request | None]) -> list[Request]:
        """The unfinished requests whose deadline has passed (finish reason "timeout"); each
        is reported once. `lookup` finds an unfinished request by id (ids are reused: the
        arrival number tells a later request apart)."""
        now, expired = time.monotonic(), []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id, arrival = heapq.heappop(self._deadlines)
            request = lookup(request_id)
            if request is not None and request.arrival_seq == arrival:
                expired.append(request)
        return expired
