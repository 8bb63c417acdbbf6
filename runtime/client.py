"""Programmatic RPC client of a running engine (`spmdrun serve`, or the one an LLM starts): the
blocking face of runtime/client_core.py; AsyncClient is the asyncio one, with the same methods."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import zmq
from spmd_runtime.protocol.messages import (
    AbortRequest,
    AddRequest,
    AdminBatchReply,
    EngineStats,
    ModelInfo,
    ModelInfoRequest,
    Ping,
    RequestDelta,
    ResetPrefixCacheRequest,
    StatsRequest,
    VictimPolicy,
)
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.client_core import (
    PING_AFTER_S,
    READY_TIMEOUT_S,
    TIMEOUT_S,
    ClientCore,
    Prompt,
    StreamDelta,
    output_of,
    prompt_refused,
)
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.rpc import EngineError, reply_or_raise

__all__ = ["Client", "EngineError", "Prompt", "StreamDelta"]


class Client(ClientCore):
    """Talks to an engine over its RPC address. Not thread-safe: use one Client per thread.

    Prompts may be texts (tokenized by the engine with the served model's tokenizer) or
    token-id lists; outputs carry the engine's text, so the client needs no tokenizer. Every
    call fails with EngineError when the engine answers nothing, pings included, for timeout_s
    (30 s by default; it is pinged after ping_after_s of silence), or `alive()` says its process
    is gone. AsyncClient has the same methods, parameters and defaults.
    """

    def __init__(self, address: str, *, timeout_s: float = TIMEOUT_S,
                 ping_after_s: float = PING_AFTER_S, alive: Callable[[], bool] | None = None,
                 admin_token: str = "", auth_token: str = "", server_key: str | bytes = "",
                 tokenizer=None) -> None:
        super().__init__(zmq.Context(), address, timeout_s=timeout_s, ping_after_s=ping_after_s,
                         alive=alive, admin_token=admin_token, auth_token=auth_token,
                         server_key=server_key)
        self._replies: dict[int, msgspec.Struct] = {}
        self._deltas: dict[int, list[RequestDelta]] = {}
        self._failures: dict[int, str] = {}
        # Set when the server refuses this client outright (no or wrong --auth-token).
        self._refused: str | None = None
        # Replies and outputs nobody waits for any more (aborts sent on the caller's behalf).
        self._ignored_tags: set[int] = set()
        self._ignored_requests: set[int] = set()
        self._tokenizer = tokenizer

    # ------------------------------------------------------------------ public API

    def wait_ready(self, timeout_s: float | None = READY_TIMEOUT_S) -> ModelInfo:
        """Wait until the engine answers (every worker loaded). EngineError when it answers
        nothing for the client's timeout_s, or is not ready within timeout_s (None: as long as
        it answers pings)."""
        self._model_info = self._call(self._tagged(ModelInfoRequest), timeout_s)
        return self._model_info

    def model_info(self) -> ModelInfo:
        """The served model and engine limits; the first call waits as wait_ready() does."""
        if self._model_info is None:
            self.wait_ready()
        return self._model_info

    def ping(self, timeout_s: float) -> bool:
        """True when the scheduler answers within timeout_s (it does even in the middle of a step)."""
        try:
            self._call(self._tagged(Ping), timeout_s)
            return True
        except (EngineError, PermissionError):
            return False

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
                 priority: int | Sequence[int] = 0, request_timeout_s: float | None = None, *,
                 chat: bool = False, on_finished: Callable[[RequestOutput], None] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the engine) and return outputs in order.

        A prompt is a text, token ids, or with chat a text (one user message) or a conversation,
        rendered with the model's chat template by the engine; one prompt or a list. params:
        one for all or one per prompt. priority (one for all, or one per prompt; larger is more
        important) decides who leaves the batch first under --thermal-victims lowest_priority.
        A request still running request_timeout_s after the engine accepted it ends with
        finish_reason "timeout". on_finished(output) is called as each one finishes, in
        whatever order they finish. A refused prompt raises ValueError naming it ("prompt 2:
        ..."), and the others are aborted."""
        requests = self._batch_requests(prompts, params, priority, request_timeout_s, chat)
        outputs = {output.request_id: output for output in self._submit_all(requests)}
        pending = set(outputs)
        try:
            while pending:
                self._pump_until(lambda: any(self._deltas.get(r) or r in self._failures
                                             for r in pending))
                for request_id in list(pending):
                    if request_id in self._failures:
                        pending.discard(request_id)
                        raise self._request_failed(self._failures.pop(request_id))
                    for delta in self._deltas.pop(request_id, []):
                        outputs[request_id].add(delta)
                        if delta.finish_reason is not None:
                            pending.discard(request_id)
                            if on_finished is not None:
                                on_finished(outputs[request_id])
        finally:
            self._abort_quietly(pending)     # whatever stopped the wait early
        return list(outputs.values())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: int | None = None, priority: int = 0,
               request_timeout_s: float | None = None, *, chat: bool = False,
               ) -> Iterator[StreamDelta]:
        """Yield new tokens, and the text they add (when the engine has a tokenizer), as they
        are generated. Sent on the first next(); leaving the loop early aborts the request."""
        request = self._stream_request(prompt, params, request_id, priority, request_timeout_s,
                                       chat)
        request_id = self._accepted(self._exchange(request)).request_id
        finished = False
        try:
            while not finished:
                self._pump_until(lambda: bool(self._deltas.get(request_id))
                                 or request_id in self._failures)
                if request_id in self._failures:
                    finished = True
                    raise self._request_failed(self._failures.pop(request_id))
                for delta in self._deltas.pop(request_id, []):
                    finished = delta.finish_reason is not None
                    yield StreamDelta.of(delta)
        finally:
            if not finished:
                self._abort_quietly({request_id})

    def abort(self, request_id: int) -> None:
        """Stop a request; its stream ends with finish_reason 'abort'. Unknown (or finished) ids
        raise ValueError."""
        self._call(self._tagged(AbortRequest, request_id=request_id))

    def abort_nowait(self, request_id: int) -> None:
        """Send an abort and forget it: the reply and any later outputs are dropped."""
        self._abort_quietly({request_id})

    def stats(self) -> EngineStats:
        """The engine's counters: a short report as str(), every figure by name in as_dict()."""
        return self._call(self._tagged(StatsRequest))

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes. Raises ValueError while requests are running."""
        self._call(self._tagged(ResetPrefixCacheRequest))

    def admin_batch(self, max_num_seqs: int | None = None, force_evict: int | None = None,
                    target_temp_c: float | None = None, policy: VictimPolicy | None = None,
                    dry_run: bool = False, *, token: str | None = None) -> AdminBatchReply:
        """Operator control of the running batch (needs --enable-admin on the server, and its
        admin token when it has one: `token`, else the client's admin_token).

        force_evict takes that many running requests off the batch now, chosen by `policy`
        (a VictimPolicy; default: the server's --thermal-victims); they
        complete later. max_num_seqs sets the cap on running requests; target_temp_c the
        thermal target. dry_run names the victims and changes nothing. Raises PermissionError
        when refused, ValueError for bad values."""
        return self._call(self._admin_batch_request(
            token, max_num_seqs=max_num_seqs, force_evict=force_evict,
            target_temp_c=target_temp_c, policy=policy, dry_run=dry_run))

    def __enter__(self) -> Client:
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
        accepted, refused = [], None
        for index, tag in enumerate(tags):
            try:
                accepted.append(self._accepted(self._replies.pop(tag)))
            except ValueError as error:
                refused = refused or prompt_refused(index, error)
        if refused is not None:
            self._abort_quietly({reply.request_id for reply in accepted})
            raise refused
        return [output_of(request, reply.request_id, reply.prompt_token_ids)
                for request, reply in zip(requests, accepted, strict=True)]

    def _call(self, message: msgspec.Struct, within_s: float | None = None):
        """Send a control message; its reply, or its error reply as ValueError or PermissionError."""
        return reply_or_raise(self._exchange(message, within_s))

    def _exchange(self, message: msgspec.Struct, within_s: float | None = None) -> msgspec.Struct:
        """Send a message and wait for the reply with its tag."""
        self._send(message)
        tag = message.tag
        try:
            self._pump_until(lambda: tag in self._replies, within_s)
        except BaseException:
            self._ignored_tags.add(tag)     # its reply, should it come, is nobody's
            raise
        return self._replies.pop(tag)

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
        frames = self._frames
        self._heard()
        while not done():
            if self._refused is not None:
                raise PermissionError(self._refused)
            if within_s is not None and time.monotonic() - started > within_s:
                raise self._timed_out(within_s, heard=self._frames > frames)
            if self._sock.poll(200, zmq.POLLIN):
                self._file(self._sock.recv())
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
