"""A worker's heartbeat to the scheduler in a multi-node job: a WorkerAlive every second from
a thread with a socket of its own, so a long step does not silence it while a frozen process
(stopped, or stuck holding the interpreter) does."""
from __future__ import annotations

import threading

import zmq
from spmd_runtime.protocol.auth import framed
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.curve import socket_keys
from spmd_runtime.protocol.messages import WorkerAlive
from spmd_runtime.protocol.transport import Encoder, make_socket

INTERVAL_S = 1.0


def start_liveness_beats(config: EngineConfig, rank: int, generation: int) -> threading.Event:
    """Beat until the returned event is set (or the process ends: the thread is a daemon)."""
    stop = threading.Event()

    def beat() -> None:
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.DEALER, config.worker_address, bind=False,
                           identity=f"alive-{rank}-{generation}".encode(),
                           curve=socket_keys(config.curve_keys, config.worker_address,
                                             server=False))
        frames = framed(config.auth_token,
                        Encoder().encode(WorkerAlive(rank=rank, generation=generation)))
        try:
            while not stop.is_set():
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass            # cut off: the queue is full, the scheduler will notice
                stop.wait(INTERVAL_S)
        finally:
            sock.close(linger=0)
            ctx.term()

    threading.Thread(target=beat, daemon=True, name=f"liveness of rank {rank}").start()
    return stop
