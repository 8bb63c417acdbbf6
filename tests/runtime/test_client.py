"""The RPC client's liveness check against stand-in servers: a live server that is slow to
answer is waited for (it answers pings), a silent one is declared down within the timeout."""
from __future__ import annotations

import threading
import time

import pytest
import zmq
from spmd_runtime.protocol.messages import Ping, Pong, RequestAccepted, client_decoder
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.transport import Encoder, private_ipc_address
from spmd_runtime.runtime.client import Client, EngineError


class StandIn:
    """A ROUTER that answers pings (or not) and accepts requests without ever finishing them."""

    def __init__(self, answer_pings: bool) -> None:
        self.address = private_ipc_address("stand-in")
        self.answer_pings = answer_pings
        self.pings = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder, encoder = client_decoder(), Encoder()
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, payload = self._sock.recv_multipart()
            message = decoder.decode(payload)
            if isinstance(message, Ping):
                self.pings += 1
                if self.answer_pings:
                    self._sock.send_multipart([identity, encoder.encode(Pong(tag=message.tag))])
            elif self.answer_pings:
                self._sock.send_multipart([identity, encoder.encode(
                    RequestAccepted(tag=message.tag, request_id=7))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()


@pytest.mark.timeout(60)
def test_a_busy_server_that_answers_pings_is_waited_for() -> None:
    server = StandIn(answer_pings=True)
    client = Client(server.address, timeout_s=1.5)
    try:
        stream = client.stream([1, 2, 3], SamplingParams(max_tokens=4))
        finished = threading.Event()

        def consume():
            try:
                next(stream)
            except EngineError:
                finished.set()
        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        thread.join(4.5)              # three times the timeout without any output
        assert thread.is_alive() and not finished.is_set()
        assert server.pings >= 2
    finally:
        server.answer_pings = False   # now it goes silent: the stream ends with an error
        thread.join(10)
        client.close()
        server.close()
    assert finished.is_set()


@pytest.mark.timeout(60)
def test_a_silent_server_is_declared_down_within_the_timeout() -> None:
    server = StandIn(answer_pings=False)
    client = Client(server.address, timeout_s=2.0)
    started = time.monotonic()
    try:
        with pytest.raises(EngineError, match="answered nothing .* for 2s: it is down"):
            client.stats()
        assert time.monotonic() - started < 10
        assert server.pings >= 1
    finally:
        client.close()
        server.close()

