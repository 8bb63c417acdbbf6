"""The connection both RPC clients share: the socket, auth frames, tags, the filing of what the
engine sends, error replies as exceptions, pings and liveness, and the EngineError they raise.
runtime/client_core.py builds on it with the requests and results; `Client` and `AsyncClient`
add only their I/O loop."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import msgspec
import zmq
from spmd_runtime.protocol.auth import framed
from spmd_runtime.protocol.curve import load_keys
from spmd_runtime.protocol.messages import (
    AdminBatchRequest,
    ErrorReply,
    Outputs,
    Ping,
    Pong,
    RequestDelta,
    server_decoder,
)
from spmd_runtime.protocol.transport import Encoder, make_socket

RPC_SCHEMES = ("tcp://", "ipc://", "inproc://")


class EngineError(RuntimeError):
    """The engine failed or stopped answering.

    `kind` says how: "unreachable" (nothing answered within the client's timeout),
    "not_ready" (it answered, but its workers were not ready in time), "exited" (its process is
    gone), "failed" (it failed a request), "closed" (the client was closed). `address` is the
    engine's RPC address; `__cause__` holds the underlying error where there is one."""

    def __init__(self, message: str, *, kind: str = "failed", address: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.address = address


def check_rpc_address(address: str) -> None:
    """ValueError unless `address` is an RPC address a client can connect to."""
    if not isinstance(address, str) or not address.startswith(RPC_SCHEMES):
        scheme = address.partition("://")[0] if isinstance(address, str) else ""
        if scheme.lower() in ("http", "https"):
            raise ValueError(
                f"{address} is an HTTP address: the HTTP front takes OpenAI clients (or plain "
                "HTTP); Client and AsyncClient need the engine's RPC address, tcp://host:port "
                "(spmdrun serve --rpc-address) or ipc://path")
        raise ValueError(f"{address!r} is not an RPC address: Client and AsyncClient need "
                         "tcp://host:port (spmdrun serve --rpc-address) or ipc://path")


def connect(ctx: zmq.Context, address: str, server_key: str | bytes = "") -> zmq.Socket:
    """A DEALER socket connected to the engine at `address` (checked first); with the server's
    CURVE public key (the key, a job.key file or the directory `spmdrun keys` made), its
    traffic is encrypted."""
    check_rpc_address(address)
    curve = None
    if server_key:
        key = server_key.decode() if isinstance(server_key, bytes) else server_key
        curve = load_keys(key, need_secret=False)
    try:
        return make_socket(ctx, zmq.DEALER, address, bind=False, curve=curve)
    except zmq.ZMQError as error:
        raise ValueError(f"cannot connect to {address}: {error}") from error


HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class HandshakeWatch:
    """Failed security handshakes of a socket (its monitor events): a wrong or missing CURVE
    key makes the engine look silent, and this says why."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, encrypted: bool) -> None:
        self.encrypted = encrypted
        address = f"inproc://handshake-{id(sock):x}"
        sock.monitor(address, HANDSHAKE_FAILURES)
        # A plain socket even beside an asyncio one: it is read without waiting.
        self._events = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self._events.connect(address)
        self.failures = 0

    def failed(self) -> bool:
        while True:
            try:
                self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.failures > 0
            self.failures += 1

    def error(self, address: str) -> "EngineError":
        if self.encrypted:
            text = (f"the engine at {address} refused the encrypted handshake: the server key "
                    "given is not its job's public key (job.key of its `spmdrun keys`), or it "
                    "does not use CURVE (then give no server key)")
        else:
            text = (f"the engine at {address} encrypts its traffic (CURVE): give the client its "
                    "job's public key, Client(address, server_key='DIR/job.key')")
        return EngineError(text, kind="handshake", address=address)

    def close(self) -> None:
        self._events.close(linger=0)


class RpcCore:
    """One DEALER connection to an engine, as both clients use it.

    Frames carry the server's --auth-token when there is one; every call gets a fresh tag;
    `_file` sorts each frame from the engine into the front's `_on_*` hooks; `_watch` pings a
    silent engine and says when it is gone. A front adds its I/O loop and its request
    bookkeeping."""

    def __init__(self, ctx: zmq.Context, address: str, *, timeout_s: float,
                 ping_after_s: float, alive: Callable[[], bool] | None, admin_token: str,
                 auth_token: str, send_flags: int = 0, server_key: str | bytes = "") -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.ping_after_s = ping_after_s
        self.admin_token = admin_token
        self._alive = alive
        self._auth_token = auth_token
        self._send_flags = send_flags
        self._ctx = ctx
        try:
            self._sock = connect(ctx, address, server_key)
        except ValueError:
            ctx.term()
            raise
        self._handshakes = HandshakeWatch(ctx, self._sock, encrypted=bool(server_key))
        self._encoder = Encoder()
        self._decoder = server_decoder()
        self._tags = itertools.count(1)
        # Frames received so far: a wait that saw this grow heard the engine answer.
        self._frames = 0
        self._last_heard = self._last_ping = time.monotonic()

    def close(self) -> None:
        self._handshakes.close()
        self._sock.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ for the fronts

    def _send(self, message: msgspec.Struct) -> None:
        self._sock.send_multipart(framed(self._auth_token, self._encoder.encode(message)),
                                  self._send_flags)

    def _admin_batch_request(self, token: str | None = None, **changes) -> AdminBatchRequest:
        try:
            return AdminBatchRequest(tag=next(self._tags),
                                     token=self.admin_token if token is None else token,
                                     **changes)
        except TypeError as error:
            raise ValueError(str(error)) from None

    def _file(self, payload: bytes) -> None:
        """Sort one frame from the engine into the hooks (msgspec.DecodeError when it is none)."""
        self._heard()
        self._frames += 1
        message = self._decoder.decode(payload)
        if isinstance(message, Pong) and message.tag == 0:
            return      # the answer to a liveness ping: hearing it was the point
        if isinstance(message, Outputs):
            for delta in message.deltas:
                self._on_delta(delta)
        elif isinstance(message, ErrorReply) and message.tag is None:
            if message.code == "forbidden":   # a frame without the server's auth token
                self._on_refused(message.message)
            else:
                self._on_request_failed(message.request_id, message.message)
        else:
            self._on_reply(message)

    def _heard(self) -> None:
        self._last_heard = time.monotonic()

    def _watch(self) -> EngineError | None:
        """Called while something is awaited and nothing arrives: the EngineError when the
        engine is gone (its process exited, or it answered nothing, pings included, for
        timeout_s); otherwise pings it once it has been silent for ping_after_s."""
        now = time.monotonic()
        if self._handshakes.failed():
            return self._handshakes.error(self.address)
        if self._alive is not None and not self._alive():
            return EngineError("the engine process exited; see its log above", kind="exited",
                               address=self.address)
        if now - self._last_heard > self.timeout_s:
            return self._timed_out(self.timeout_s, heard=False)
        if now - max(self._last_heard, self._last_ping) > self.ping_after_s:
            # Any answer proves the engine alive; the Pong itself is dropped.
            self._send(Ping(tag=0))
            self._last_ping = now
        return None

    def _timed_out(self, waited_s: float, heard: bool) -> EngineError:
        if not heard and self._handshakes.failed():
            return self._handshakes.error(self.address)
        if heard:
            return EngineError(f"the engine at {self.address} answers, but was not ready within "
                               f"{waited_s:g}s", kind="not_ready", address=self.address)
        return EngineError(f"the engine at {self.address} answered nothing (not even a ping) "
                           f"within {waited_s:g}s: it is down, unreachable, or not at this "
                           "address", kind="unreachable", address=self.address)

    # ------------------------------------------------------------------ the fronts' hooks

    def _on_delta(self, delta: RequestDelta) -> None:
        raise NotImplementedError

    def _on_refused(self, reason: str) -> None:
        """The server refuses this client outright (no or wrong --auth-token)."""
        raise NotImplementedError

    def _on_request_failed(self, request_id: int | None, reason: str) -> None:
        raise NotImplementedError

    def _on_reply(self, message: msgspec.Struct) -> None:
        """A reply to the call with its tag (one with an unknown tag is dropped)."""
        raise NotImplementedError


def reply_or_raise(reply: msgspec.Struct):
    """The reply of a call, or its ErrorReply as PermissionError (refused) or ValueError."""
    if isinstance(reply, ErrorReply):
        if reply.code in ("forbidden", "disabled"):
            raise PermissionError(reply.message)
        raise ValueError(reply.message)
    return reply
