"""The scheduler's client-facing ROUTER socket: bound at start, it refuses bad frames, answers
pings at once (even while the workers load or compute) and queues the rest for the step loop."""
from __future__ import annotations

import msgspec
import zmq
from spmd_runtime.protocol.auth import AuthRejected, checked_payload
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.curve import socket_keys
from spmd_runtime.protocol.messages import (
    DECODE_ERRORS,
    ClientMessage,
    ErrorReply,
    Ping,
    Pong,
    client_decoder,
)
from spmd_runtime.protocol.transport import Encoder, bound_address, make_socket

CLIENT_MESSAGE_TAGS = frozenset(
    msgspec.inspect.type_info(kind).tag for kind in ClientMessage.__args__)
MAX_CLIENT_MESSAGES_PER_STEP = 1024


class RpcFront:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, encoder: Encoder) -> None:
        """Binds config.rpc_address; transport.BindError (a zmq.ZMQError) naming the address
        when that fails (in use, or not an address of this host)."""
        self.config = config
        self.encoder = encoder
        self.decoder = client_decoder()
        self.socket = make_socket(ctx, zmq.ROUTER, config.rpc_address, bind=True,
                                  curve=socket_keys(config.curve_keys, config.rpc_address,
                                                    server=True))
        # Past this, zmq drops the connection without reading the frame into memory.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_message_bytes)
        # Decoded client messages waiting for the loop (pings are answered on arrival).
        self.pending: list[tuple[bytes, msgspec.Struct]] = []
        self.rejected_frames = 0

    @property
    def address(self) -> str:
        return bound_address(self.socket)

    def receive(self) -> None:
        """Read what clients sent: refuse bad frames, answer pings, queue the rest."""
        while len(self.pending) < MAX_CLIENT_MESSAGES_PER_STEP:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            client = frames[0]
            try:
                payload = checked_payload(frames[1:], self.config.auth_token)
            except AuthRejected as error:
                self.rejected_frames += 1
                self.reply(client, ErrorReply(tag=None, code="forbidden", message=(
                    f"{error} (Client(address, auth_token=...) takes the server's "
                    "--auth-token)")))
                continue
            limit = self.config.max_message_bytes
            if len(payload) > limit:
                self._reject(client, payload, (
                    f"message of {len(payload)} bytes is larger than the server's "
                    f"--max-message-bytes {limit}; send a shorter prompt"))
                continue
            try:
                message = self.decoder.decode(payload)
            except DECODE_ERRORS as error:
                self._reject(client, payload, f"invalid request: {error}")
                continue
            if isinstance(message, Ping):
                self.reply(client, Pong(tag=message.tag))
            else:
                self.pending.append((client, message))

    def take(self, block: bool) -> list[tuple[bytes, msgspec.Struct]]:
        """The queued messages after reading the socket; `block`: wait up to 0.1 s for one."""
        if block and not self.pending and not self.socket.poll(100, zmq.POLLIN):
            return []
        self.receive()
        pending, self.pending = self.pending, []
        return pending

    def reply(self, client: bytes, message: msgspec.Struct) -> bool:
        """Send to one client; False when it is gone (or its queue is full)."""
        try:
            self.socket.send_multipart([client, self.encoder.encode(message)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def _reject(self, client: bytes, payload: bytes, reason: str) -> None:
        self.rejected_frames += 1
        self.reply(client, ErrorReply(tag=_tag_of(payload), message=reason))

    def close(self) -> None:
        self.socket.close(linger=0)


def _tag_of(payload: bytes) -> int | None:
    """The client's tag of a frame that is msgpack but not a valid request, so the client can
    tell which of its requests was refused. Plain msgpack decoding: no objects are built."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except DECODE_ERRORS:
        return None
    if isinstance(fields, list) and len(fields) > 1 and isinstance(fields[0], str) \
            and fields[0] in CLIENT_MESSAGE_TAGS \
            and isinstance(fields[1], int) and not isinstance(fields[1], bool):
        return fields[1]
    return None
