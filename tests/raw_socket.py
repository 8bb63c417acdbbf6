"""A bare DEALER socket speaking msgpack to a running server, like a non-Python client."""
from __future__ import annotations

import zmq
from spmd_runtime.protocol.messages import server_decoder


class RawSocket:
    """A bare DEALER socket speaking msgpack to the server, like a non-Python client would."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.decoder = server_decoder()

    def send(self, payload: bytes) -> None:
        self.sock.send(payload)

    def recv(self, timeout_s: float = 30.0):
        assert self.sock.poll(int(timeout_s * 1000)), "no reply from the server"
        return self.decoder.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
