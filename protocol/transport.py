"""ZeroMQ plumbing: socket factory, addresses, bounded receives. Frames are msgspec only."""
from __future__ import annotations

import os
import socket
import tempfile
import uuid

import msgspec
import zmq
from spmd_runtime.protocol.curve import CurveKeys, secure_client, secure_server

# Bounded queues: a stalled peer makes senders block or error instead of growing memory forever.
DEFAULT_HWM = 10_000


class BindError(zmq.ZMQError):
    """A socket could not listen on `address` (in use, or not an address of this host)."""

    def __init__(self, address: str, error: zmq.ZMQError) -> None:
        # zmq appends " (addr='...')" to the reason; the message names the address itself.
        self.address = address
        self.reason = str(error.strerror).split(" (addr=")[0]
        super().__init__(error.errno, f"cannot listen on {address}: {self.reason}")


def make_socket(ctx: zmq.Context, kind: int, address: str, *, bind: bool,
                identity: bytes | None = None, hwm: int = DEFAULT_HWM,
                curve: CurveKeys | None = None) -> zmq.Socket:
    """A socket with linger 0 (close never blocks) bound or connected to `address`. With
    `curve`, its traffic is encrypted: a bound socket is the CURVE server (the keys must hold
    the secret key), a connected one a client of the server with that public key."""
    sock = ctx.socket(kind)
    if curve is not None:
        if bind:
            secure_server(sock, curve)
        else:
            secure_client(sock, curve.public)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Sending to a peer that is gone raises instead of silently dropping.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if bind:
        try:
            sock.bind(address)
        except zmq.ZMQError as error:
            sock.close()        # left open, it would keep its context's term() waiting forever
            raise BindError(address, error) from error
    else:
        sock.connect(address)
    return sock


def bound_address(sock: zmq.Socket) -> str:
    """The concrete address of a bound socket (resolves tcp://host:* to the chosen port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def private_ipc_address(name: str) -> str:
    """A fresh ipc:// address in a private temporary directory (short enough for AF_UNIX)."""
    directory = tempfile.mkdtemp(prefix="spmd-")
    return f"ipc://{os.path.join(directory, f'{name}-{uuid.uuid4().hex[:8]}')}"


def poll_recv(sock: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    """Receive one multipart message, or None if nothing arrived within timeout_s."""
    if sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return sock.recv_multipart(copy=True)
    return None


class Encoder:
    """One reusable msgpack encoder; `encode` once and send the same bytes to every peer."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)
