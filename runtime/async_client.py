"""Asyncio RPC client of a running engine, the awaiting face of runtime/client_core.py (Client is
the blocking one, with the same methods): many concurrent requests share one DEALER socket.

One reader task files every frame: control replies resolve the caller's future by tag, output
deltas go to the queue of their request's RequestStream. Used by the HTTP front and by
`spmdrun bench serving`.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec
import zmq
import zmq.asyncio
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

log = logging.getLogger("spmd.async_client")


class RequestStream:
    """The deltas of one accepted request, in order, until the one with a finish_reason.

    `async for delta in stream`; close() aborts the request unless it has finished, without
    awaiting, so it is safe in the `finally` of a cancelled task, and ends the iteration of
    whoever still waits on the stream.
    """

    def __init__(self, client: AsyncClient, request_id: int,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        # The prompt as the engine tokenized it (texts and conversations; None for token ids).
        self.prompt_token_ids = prompt_token_ids
        self.finished = False
        self._client = client
        # None: closed by its owner; an exception: the request failed.
        self._queue: asyncio.Queue[RequestDelta | Exception | None] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._client.abort_nowait(self.request_id)
            self._queue.put_nowait(None)


class AsyncClient(ClientCore):
    """Talks to an engine over its RPC address from one asyncio event loop.

    The same methods, parameters and defaults as Client (awaited; `async for` over stream()),
    plus submit(), the HTTP front's building block. A call waits as long as the engine answers
    anything; when the engine has been silent for timeout_s while calls or requests are
    outstanding (it is pinged after ping_after_s), or `alive()` says its process is gone, they
    fail with EngineError. Texts are tokenized by the engine and deltas carry its text: the
    client needs no tokenizer.
    """

    def __init__(self, address: str, *, timeout_s: float = TIMEOUT_S,
                 ping_after_s: float = PING_AFTER_S, alive: Callable[[], bool] | None = None,
                 admin_token: str = "", auth_token: str = "",
                 server_key: str | bytes = "") -> None:
        # Sends queue locally (bounded by the high-water mark) and never block the event loop.
        super().__init__(zmq.asyncio.Context(), address, timeout_s=timeout_s,
                         ping_after_s=ping_after_s, alive=alive, admin_token=admin_token,
                         auth_token=auth_token, server_key=server_key, send_flags=zmq.NOBLOCK)
        self._calls: dict[int, asyncio.Future] = {}
        self._adds: dict[int, asyncio.Future] = {}
        self._streams: dict[int, RequestStream] = {}
        self._reader: asyncio.Task | None = None

    # ------------------------------------------------------------------ public API

    async def wait_ready(self, timeout_s: float | None = READY_TIMEOUT_S) -> ModelInfo:
        """As Client.wait_ready."""
        frames = self._frames
        try:
            self._model_info = await asyncio.wait_for(
                self._call(self._tagged(ModelInfoRequest)), timeout_s)
        except asyncio.TimeoutError:
            raise self._timed_out(timeout_s, heard=self._frames > frames) from None
        return self._model_info

    async def model_info(self) -> ModelInfo:
        """As Client.model_info."""
        if self._model_info is None:
            await self.wait_ready()
        return self._model_info

    async def ping(self, timeout_s: float) -> bool:
        """As Client.ping."""
        try:
            await asyncio.wait_for(self._call(self._tagged(Ping)), timeout_s)
            return True
        except (asyncio.TimeoutError, EngineError, PermissionError):
            return False

    async def generate(self, prompts: Prompt | Sequence[Prompt],
                       params: SamplingParams | Sequence[SamplingParams] | None = None,
                       priority: int | Sequence[int] = 0, request_timeout_s: float | None = None,
                       *, chat: bool = False,
                       on_finished: Callable[[RequestOutput], None] | None = None,
                       ) -> list[RequestOutput]:
        """As Client.generate."""
        requests = self._batch_requests(prompts, params, priority, request_timeout_s, chat)
        streams: list[RequestStream] = []
        try:
            # Every request is sent before any acceptance is awaited: the engine accepts what
            # has arrived between two steps, so awaiting each in turn would admit one per step.
            accepted = [self._send_add(request) for request in requests]
            refused = None
            for index, future in enumerate(accepted):
                try:
                    streams.append(await future)
                except ValueError as error:
                    refused = refused or prompt_refused(index, error)
            if refused is not None:
                raise refused       # the accepted ones are aborted below

            async def collect(request: AddRequest, stream: RequestStream) -> RequestOutput:
                output = output_of(request, stream.request_id, stream.prompt_token_ids)
                async for delta in stream:
                    output.add(delta)
                if on_finished is not None:
                    on_finished(output)
                return output

            return list(await asyncio.gather(*(collect(request, stream) for request, stream
                                               in zip(requests, streams, strict=True))))
        finally:
            for stream in streams:
                stream.close()

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: int | None = None, priority: int = 0,
                     request_timeout_s: float | None = None, *, chat: bool = False,
                     ) -> AsyncIterator[StreamDelta]:
        """As Client.stream: `async for delta in client.stream(...)`."""
        request = self._stream_request(prompt, params, request_id, priority, request_timeout_s,
                                       chat)
        request_stream = await self._send_add(request)
        try:
            async for delta in request_stream:
                yield StreamDelta.of(delta)
        finally:
            request_stream.close()

    async def submit(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: int | None = None, priority: int = 0,
                     timeout_s: float | None = None, *, chat: bool = False,
                     detokenize: bool = True) -> RequestStream:
        """Add a request, as stream() does, and return its RequestStream of raw RequestDeltas
        once the engine accepts it (ValueError with the engine's reason when it refuses it).
        timeout_s is stream()'s request_timeout_s. detokenize=False: the deltas carry no text
        (for callers that decode themselves)."""
        return await self._send_add(self._stream_request(
            prompt, params, request_id, priority, timeout_s, chat, detokenize))

    async def abort(self, request_id: int) -> None:
        """As Client.abort."""
        await self._call(self._tagged(AbortRequest, request_id=request_id))

    def abort_nowait(self, request_id: int) -> None:
        """As Client.abort_nowait (not awaited: safe in the `finally` of a cancelled task)."""
        self._streams.pop(request_id, None)
        self._send(self._tagged(AbortRequest, request_id=request_id))

    async def stats(self) -> EngineStats:
        """As Client.stats."""
        return await self._call(self._tagged(StatsRequest))

    async def reset_prefix_cache(self) -> None:
        """As Client.reset_prefix_cache."""
        await self._call(self._tagged(ResetPrefixCacheRequest))

    async def admin_batch(self, max_num_seqs: int | None = None, force_evict: int | None = None,
                          target_temp_c: float | None = None, policy: VictimPolicy | None = None,
                          dry_run: bool = False, *, token: str | None = None) -> AdminBatchReply:
        """As Client.admin_batch."""
        return await self._call(self._admin_batch_request(
            token, max_num_seqs=max_num_seqs, force_evict=force_evict,
            target_temp_c=target_temp_c, policy=policy, dry_run=dry_run))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._fail_all(EngineError("the client was closed", kind="closed", address=self.address))
        super().close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _send_add(self, request: AddRequest) -> asyncio.Future:
        """Send an AddRequest; the future resolves to its stream once the engine accepts it."""
        future = self._expect(self._adds, request.tag)
        self._send(request)
        return future

    def _expect(self, table: dict[int, asyncio.Future], tag: int) -> asyncio.Future:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        future = asyncio.get_running_loop().create_future()
        table[tag] = future
        return future

    async def _call(self, message: msgspec.Struct):
        future = self._expect(self._calls, message.tag)
        self._send(message)
        try:
            reply = await future
        finally:
            self._calls.pop(message.tag, None)
        return reply_or_raise(reply)

    def _outstanding(self) -> bool:
        return bool(self._calls or self._adds or self._streams)

    async def _read(self) -> None:
        """File every frame; ping a silent engine and fail everyone when it stays silent."""
        try:
            await self._read_forever()
        except asyncio.CancelledError:
            raise
        except Exception as error:   # a bug here must not leave every caller waiting forever
            log.exception("the RPC reader failed")
            self._fail_all(EngineError(f"the RPC reader failed: {error!r}"))

    async def _read_forever(self) -> None:
        self._heard()
        while True:
            if await self._sock.poll(200, zmq.POLLIN):
                payload = await self._sock.recv()
                try:
                    self._file(payload)
                except msgspec.DecodeError as error:
                    log.warning("undecodable frame from the engine: %s", error)
                continue
            if not self._outstanding():
                self._heard()
                continue
            gone = self._watch()
            if gone is not None:
                self._fail_all(gone)
                self._heard()

    def _on_delta(self, delta: RequestDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return      # aborted by us: its last deltas are of no interest
        if delta.finish_reason is not None:
            del self._streams[delta.request_id]
        stream._queue.put_nowait(delta)

    def _on_refused(self, reason: str) -> None:
        self._fail_all(PermissionError(reason))

    def _on_request_failed(self, request_id: int | None, reason: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._queue.put_nowait(self._request_failed(reason))
        else:
            log.warning("engine error: %s", reason)

    def _on_reply(self, message: msgspec.Struct) -> None:
        add = self._adds.pop(message.tag, None)
        if add is not None:
            self._resolve_add(add, message)
            return
        call = self._calls.get(message.tag)
        if call is not None and not call.done():
            call.set_result(message)

    def _resolve_add(self, future: asyncio.Future, message: msgspec.Struct) -> None:
        try:
            accepted = self._accepted(message)
        except ValueError as error:
            if not future.done():
                future.set_exception(error)
            return
        # Registered before the caller resumes: the next frame may already carry its tokens.
        stream = RequestStream(self, accepted.request_id, accepted.prompt_token_ids or None)
        self._streams[accepted.request_id] = stream
        if future.done():   # the caller gave up (cancelled) while the add was in flight
            stream.close()
        else:
            future.set_result(stream)

    def _fail_all(self, error: Exception) -> None:
        for table in (self._calls, self._adds):
            for future in table.values():
                if not future.done():
                    future.set_exception(error)
            table.clear()
        for stream in self._streams.values():
            stream._queue.put_nowait(error)
        self._streams.clear()
