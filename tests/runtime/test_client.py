"""The RPC client's liveness check against stand-in servers: a live server that is slow to
answer is waited for (it answers pings), a silent one is declared down within the timeout, and
so is an address nobody serves; addresses that are not RPC addresses are refused at once."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
from spmd_runtime.protocol.messages import Ping, Pong, RequestAccepted, client_decoder
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.transport import Encoder, free_tcp_port, private_ipc_address
from spmd_runtime.runtime.async_client import AsyncClient
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
        with pytest.raises(EngineError, match="answered nothing .* within 2s: it is down"):
            client.stats()
        assert time.monotonic() - started < 10
        assert server.pings >= 1
    finally:
        client.close()
        server.close()



@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["generate", "wait_ready", "model_info", "stream"])
def test_a_client_of_an_address_nobody_serves_fails_within_its_timeout(call) -> None:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    started = time.monotonic()
    with Client(address, timeout_s=2) as client:
        with pytest.raises(EngineError) as raised:
            if call == "generate":
                client.generate(["a text prompt"])
            elif call == "stream":
                next(client.stream([1, 2, 3]))
            else:
                getattr(client, call)()
    assert time.monotonic() - started < 15
    assert raised.value.kind == "unreachable" and raised.value.address == address
    assert f"the engine at {address} answered nothing (not even a ping) within 2s" \
        in str(raised.value)


@pytest.mark.timeout(60)
def test_an_async_client_of_an_address_nobody_serves_fails_within_its_timeout() -> None:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"

    async def run(call):
        async with AsyncClient(address, timeout_s=2) as client:
            return await call(client)
    for call in (lambda c: c.wait_ready(),
                 lambda c: c.generate(["a text prompt"], [SamplingParams()])):
        started = time.monotonic()
        with pytest.raises(EngineError, match=f"{address} answered nothing .* within 2s") as raised:
            asyncio.run(run(call))
        assert time.monotonic() - started < 15
        assert raised.value.kind == "unreachable"


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_an_address_that_is_not_an_rpc_address_is_refused_at_once(cls) -> None:
    with pytest.raises(ValueError, match="HTTP front takes OpenAI clients.* need the engine's "
                                         "RPC address, tcp://host:port"):
        cls("http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="not an RPC address"):
        cls("127.0.0.1:5555")
