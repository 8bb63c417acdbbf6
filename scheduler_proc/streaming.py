"""Streaming results: after each step every client gets one frame holding the new tokens
(and text) of all its requests; a request sent with stream=False, its whole output in one delta
when it ends."""
from __future__ import annotations

import time
from collections.abc import Callable

from spmd_runtime.protocol.messages import Outputs, RequestDelta
from spmd_runtime.scheduler_proc.finishing import FinishRules
from spmd_runtime.scheduler_proc.rpc_front import RpcFront
from spmd_runtime.scheduler_proc.scheduler import StepUpdate
from spmd_runtime.scheduler_proc.served_tokenizer import ServedTokenizer


class QuietClients:
    """Clients waiting on requests that send nothing until they end (stream=False): each gets an
    empty frame at most every CHECK_S, so that one gone is noticed (the send fails) while its
    requests still run, and the client hears the engine alive."""

    CHECK_S = 0.5

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._quiet_since: dict[bytes, float] = {}   # last frame to each quiet client

    def heard(self, client: bytes) -> None:
        """The client got a frame: its quiet time starts over."""
        self._quiet_since.pop(client, None)

    def check(self, front: RpcFront, clients: set[bytes]) -> list[bytes]:
        """Send the empty frame to those of `clients` quiet for CHECK_S; the ones gone."""
        now, gone = self._clock(), []
        for client in clients:
            if now - self._quiet_since.setdefault(client, now) >= self.CHECK_S:
                self._quiet_since[client] = now
                if not front.reply(client, Outputs(deltas=[])):
                    gone.append(client)
        return gone


def stream_update(front: RpcFront, tokenizer: ServedTokenizer, update: StepUpdate,
                  quiet: QuietClients | None = None) -> tuple[list[bytes], list[int]]:
    """Send what the update's requests produced since they were last streamed (a request with
    stream=False: only once it ends, its quiet client checked on by `quiet`); returns the
    clients that could not be reached (gone, or not reading), and the requests whose text
    reached a stop string: they are reported finished ("stop") and should end now."""
    stopped: list[int] = []
    by_client: dict[bytes, list[RequestDelta]] = {}
    seen: set[int] = set()
    waiting: set[bytes] = set()
    for request in update.progressed + update.finished:
        if request.request_id in seen:
            continue
        seen.add(request.request_id)
        if not request.stream and request.finish_reason is None:
            waiting.add(request.client)
            continue
        first = request.num_tokens_streamed == 0
        new_tokens = request.output_token_ids[request.num_tokens_streamed:]
        logprobs = request.output_logprobs[request.num_tokens_streamed:] \
            if request.params.logprobs is not None else None
        request.num_tokens_streamed = len(request.output_token_ids)
        reason = request.finish_reason.value if request.finish_reason else None
        if len(new_tokens) > 1 and request.params.stop:
            new_tokens, text, hit_stop = _text_to_stop(tokenizer, request, new_tokens,
                                                       reason is not None)
        else:
            text, hit_stop = tokenizer.text(request.request_id, new_tokens, reason is not None)
        text_reason = FinishRules.after_text(hit_stop)
        if text_reason is not None and reason is None:
            reason = text_reason.value
            stopped.append(request.request_id)
        by_client.setdefault(request.client, []).append(
            RequestDelta(request.request_id, new_tokens, reason, text,
                         request.queue_time_s if first else None, logprobs,
                         request.prompt_logprobs if first and request.params.prompt_logprobs
                         is not None else None))
    unreachable = [client for client, deltas in by_client.items()
                   if not front.reply(client, Outputs(deltas=deltas))]
    if quiet is not None:
        for client in by_client:
            quiet.heard(client)
        unreachable += quiet.check(front, waiting - by_client.keys())
    return unreachable, stopped


def _text_to_stop(tokenizer: ServedTokenizer, request, new_tokens: list[int],
                  finished: bool) -> tuple[list[int], str, bool]:
    """Several new tokens (speculative decoding) of a request with stop strings: their text a
    token at a time, so that the tokens after the one completing a stop string are dropped,
    as decoding token by token would never have made them."""
    pieces = []
    for index, token in enumerate(new_tokens):
        last = index == len(new_tokens) - 1
        piece, hit_stop = tokenizer.text(request.request_id, [token], finished and last)
        pieces.append(piece)
        if hit_stop:
            del request.output_token_ids[len(request.output_token_ids) - len(new_tokens) + index + 1:]
            request.num_tokens_streamed = len(request.output_token_ids)
            return new_tokens[:index + 1], "".join(pieces), True
    return new_tokens, "".join(pieces), False
