"""The scheduler's RPC socket is bound at start, before any worker is waited for: a taken
address fails the scheduler at once, naming it, and a loading scheduler answers pings (so
clients wait for it) without answering the readiness probe."""
from __future__ import annotations

import threading

import pytest
import zmq
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.transport import free_tcp_port, private_ipc_address
from spmd_runtime.runtime.client import Client, EngineError
from spmd_runtime.scheduler_proc.server import SchedulerServer
from spmd_runtime.scheduler_proc.worker_group import WorkersFailed


def config(rpc_address: str) -> EngineConfig:
    return EngineConfig(model="dummy:tiny-llama", rpc_address=rpc_address,
                        worker_address=private_ipc_address("workers"))


@pytest.mark.timeout(30)
def test_a_taken_rpc_address_fails_the_scheduler_at_once() -> None:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    ctx = zmq.Context()
    other = ctx.socket(zmq.ROUTER)
    try:
        other.bind(address)
        with pytest.raises(zmq.ZMQError, match=f"cannot listen on {address}: "
                                               "Address already in use"):
            SchedulerServer(config(address))
    finally:
        other.close(linger=0)
        ctx.term()


@pytest.mark.timeout(60)
def test_a_loading_scheduler_answers_pings_but_is_not_ready() -> None:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    server = SchedulerServer(config(address))
    outcome: list[BaseException] = []

    def wait():
        try:
            server.wait_for_workers()      # no worker ever comes
        except WorkersFailed as error:
            outcome.append(error)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        # Silent for 1.5 s would be "unreachable": the pings it answers keep the client waiting
        # until the readiness deadline.
        with Client(address, timeout_s=1.5) as client:
            with pytest.raises(EngineError, match=f"the engine at {address} answers, but was "
                                                  "not ready within 4s") as raised:
                client.wait_ready(4)
        assert raised.value.kind == "not_ready"
    finally:
        server.stop()
        waiter.join(10)
        server.close()
    assert not waiter.is_alive() and outcome, "a stop ends the wait for workers"
