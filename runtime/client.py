"""Programmatic RPC client of a running engine (`spmdrun serve`, or the one an LLM starts)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgspec
import zmq
from spmd_runtime.protocol.logprobs import TokenLogprobs
from spmd_runtime.protocol.messages import (
    AbortRequest,
    AddRequest,
    AdminBatchReply,
    EngineStats,
    ErrorReply,
    ModelInfo,
    ModelInfoRequest,
    RequestAccepted,
    RequestDelta,
    ResetPrefixCacheRequest,
    StatsRequest,
    VictimPolicy,
)
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.rpc import (
    EngineError,
    Prompt,
    RpcCore,
    add_request,
    as_param_list,
    as_prompt_list,
    reply_or_raise,
)

__all__ = ["Client", "EngineError", "Prompt", "StreamDelta"]


@dataclass
class StreamDelta:
    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # As RequestOutput's: one record per token (with SamplingParams.logprobs); the prompt's on
    # the first delta (with prompt_logprobs).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Client(RpcCore):
    """Talks to an engine over its RPC address. Not thread-safe: use one Client per thread.

    Prompts may be texts (tokenized by the engine with the served model's tokenizer) or
    token-id lists; outputs carry the engine's text, so the client needs no tokenizer. Every
    call fails with EngineError when the engine answers nothing, pings included, for timeout_s.
    """

    # Silence after which the client pings the engine (answered even mid-step).
    PING_INTERVAL_S = 1.0

    def __init__(self, address: str, *, tokenizer=None, timeout_s: float = 30.0,
                 alive: Callable[[], bool] | None = None, admin_token: str = "",
                 auth_token: str = "", server_key: str | bytes = "") -> None:
        super().__init__(zmq.Context(), address, timeout_s=timeout_s,
                         ping_after_s=self.PING_INTERVAL_S, alive=alive,
                         admin_token=admin_token, auth_token=auth_token, server_key=server_key)
        self._replies: dict[int, msgspec.Struct] = {}
        self._deltas: dict[int, list[RequestDelta]] = {}
        self._failures: dict[int, str] = {}
        # Set when the server refuses this client outright (no or wrong --auth-token).
        self._refused: str | None = None
        # Replies and outputs nobody waits for any more (aborts sent on the caller's behalf).
        self._ignored_tags: set[int] = set()
        self._ignored_requests: set[int] = set()
        self._tokenizer = tokenizer
        self._model_info: ModelInfo | None = None

    # ------------------------------------------------------------------ public API

    def wait_ready(self, timeout_s: float = 600.0) -> ModelInfo:
        """Block until the engine answers (every worker loaded), or raise EngineError: when it
        is not ready within timeout_s, or answers nothing at all for the client's timeout_s."""
        self._model_info = self._call(ModelInfoRequest(tag=next(self._tags)), timeout_s)
        return self._model_info

    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            self.wait_ready(self.timeout_s)
        return self._model_info

    @property
    def tokenizer(self):
        """The served model's tokenizer, loaded here (needs transformers and the model files).
        Generation needs none: the engine tokenizes texts and sends text with its outputs."""
        if self._tokenizer is None:
            from spmd_runtime.protocol.model_source import resolve_model
            from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(resolve_model(self.model_info().model))
        return self._tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text with the local tokenizer (see `tokenizer`); ids pass through."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] = 0,
                 request_timeout_s: float | None = None, *, chat: bool = False,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the engine) and return outputs in order.

        With chat, each prompt (a text, taken as one user message, or a conversation) is
        rendered with the model's chat template by the engine. priority (one for all, or one
        per prompt; larger is more important) decides who leaves the batch first under
        --thermal-victims lowest_priority. A request still running request_timeout_s after the
        engine accepted it ends with finish_reason "timeout"."""
        prompt_list = as_prompt_list(prompts)
        param_list = as_param_list(params, len(prompt_list))
        priorities = [priority] * len(prompt_list) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        requests = [add_request(next(self._tags), prompt, p, chat=chat, priority=rank,
                                timeout_s=request_timeout_s)
                    for prompt, p, rank in zip(prompt_list, param_list, priorities, strict=True)]
        outputs = {output.request_id: output for output in self._submit_all(requests)}
        pending = set(outputs)
        while pending:
            self._pump_until(lambda: any(self._deltas.get(r) or r in self._failures for r in pending))
            for request_id in list(pending):
                if request_id in self._failures:
                    self._abort_quietly(pending - {request_id})
                    raise EngineError(self._failures.pop(request_id), address=self.address)
                for delta in self._deltas.pop(request_id, []):
                    outputs[request_id].add(delta)
                    if delta.finish_reason is not None:
                        pending.discard(request_id)
        return list(outputs.values())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: int | None = None, priority: int = 0,
               request_timeout_s: float | None = None, *, chat: bool = False,
               ) -> Iterator[StreamDelta]:
        """Yield new tokens, and the text they add (when the engine has a tokenizer), as they
        are generated."""
        request = add_request(next(self._tags), prompt, params or SamplingParams(), chat=chat,
                              request_id=request_id, priority=priority,
                              timeout_s=request_timeout_s)
        request_id = self._call(request).request_id
        finished = False
        try:
            while not finished:
                self._pump_until(lambda: bool(self._deltas.get(request_id))
                                 or request_id in self._failures)
                if request_id in self._failures:
                    finished = True
                    raise EngineError(self._failures.pop(request_id), address=self.address)
                for delta in self._deltas.pop(request_id, []):
                    finished = delta.finish_reason is not None
                    yield StreamDelta(request_id, delta.token_ids, delta.text, delta.finish_reason,
                                      delta.logprobs, delta.prompt_logprobs)
        finally:
            if not finished:
                self._abort_quietly({request_id})

    def abort(self, request_id: int) -> None:
        """Stop a request; its stream ends with finish_reason 'abort'. Unknown ids raise ValueError."""
        self._call(AbortRequest(tag=next(self._tags), request_id=request_id))

    def stats(self) -> EngineStats:
        return self._call(StatsRequest(tag=next(self._tags)))

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes. Raises ValueError while requests are running."""
        self._call(ResetPrefixCacheRequest(tag=next(self._tags)))

    def admin_batch(self, max_num_seqs: int | None = None, force_evict: int | None = None,
                    target_temp_c: float | None = None, policy: VictimPolicy | None = None,
                    dry_run: bool = False) -> AdminBatchReply:
        """Operator control of the running batch (needs --enable-admin on the server, and this
        client's admin_token when the server has one).

        force_evict takes that many running requests off the batch now, chosen by `policy`
        (a VictimPolicy; default: the server's --thermal-victims); they
        complete later. max_num_seqs sets the cap on running requests; target_temp_c the
        thermal target. dry_run names the victims and changes nothing. Raises PermissionError
        when refused, ValueError for bad values."""
        return self._call(self._admin_batch_request(
            max_num_seqs=max_num_seqs, force_evict=force_evict, target_temp_c=target_temp_c,
            policy=policy, dry_run=dry_run))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _submit_all(self, requests: list[AddRequest]) -> list[RequestOutput]:
        """Send every request before awaiting any acceptance: the engine admits what arrived
        between two steps together. Their outputs to fill, in order; ValueError naming the
        first refused prompt (the accepted ones are aborted)."""
        for request in requests:
            self._send(request)
        tags = [request.tag for request in requests]
        self._pump_until(lambda: all(t in self._replies for t in tags))
        replies = [self._replies.pop(t) for t in tags]
        errors = [r for r in replies if isinstance(r, ErrorReply)]
        if errors:
            self._abort_quietly({r.request_id for r in replies if isinstance(r, RequestAccepted)})
            index = replies.index(errors[0])
            raise ValueError(f"prompt {index}: {errors[0].message}")
        return [RequestOutput(reply.request_id, reply.prompt_token_ids or request.prompt_token_ids)
                for request, reply in zip(requests, replies, strict=True)]

    def _call(self, message: msgspec.Struct, within_s: float | None = None):
        self._send(message)
        tag = message.tag
        self._pump_until(lambda: tag in self._replies, within_s)
        return reply_or_raise(self._replies.pop(tag))

    def _abort_quietly(self, request_ids: set[int]) -> None:
        for request_id in request_ids:
            tag = next(self._tags)
            self._ignored_tags.add(tag)
            self._ignored_requests.add(request_id)
            self._send(AbortRequest(tag=tag, request_id=request_id))
            self._deltas.pop(request_id, None)

    def _pump_until(self, done: Callable[[], bool], within_s: float | None = None) -> None:
        """Receive and file messages until `done()`. EngineError when the engine is gone (its
        process exited, or it answered nothing, pings included, for timeout_s) or `done()` is
        still false after within_s."""
        started = time.monotonic()
        self._heard()
        heard = False
        while not done():
            if self._refused is not None:
                raise PermissionError(self._refused)
            if within_s is not None and time.monotonic() - started > within_s:
                raise self._timed_out(within_s, heard)
            if self._sock.poll(200, zmq.POLLIN):
                self._file(self._sock.recv())
                heard = True
                continue
            gone = self._watch()
            if gone is not None:
                raise gone

    def _on_delta(self, delta: RequestDelta) -> None:
        if delta.request_id in self._ignored_requests:
            if delta.finish_reason is not None:
                self._ignored_requests.discard(delta.request_id)
            return
        self._deltas.setdefault(delta.request_id, []).append(delta)

    def _on_refused(self, reason: str) -> None:
        self._refused = reason

    def _on_request_failed(self, request_id: int | None, reason: str) -> None:
        if request_id is not None and request_id not in self._ignored_requests:
            self._failures[request_id] = reason

    def _on_reply(self, message: msgspec.Struct) -> None:
        if message.tag in self._ignored_tags:
            self._ignored_tags.discard(message.tag)
        else:
            self._replies[message.tag] = message
