"""A launcher's link to node 0's scheduler in a multi-node job (on every node, node 0 too).

A NodeHeartbeat every second says the node lives and which generation of workers it runs;
StartWorkers from the scheduler replaces this node's workers by a new generation (the whole
group restarts when any node loses a worker, goes silent or comes back); EndJob, or node 0
silent past --rejoin-timeout-s, ends the job. A worker of this node that dies is reported,
not restarted here: node 0 decides. It runs on a thread of its own, so the heartbeats go on
whatever the launcher's main thread waits on."""
from __future__ import annotations

import logging
import queue
import threading
import time

import zmq
from spmd_runtime.launch.engine import start_workers
from spmd_runtime.launch.supervisor import Child, Supervisor
from spmd_runtime.protocol.auth import framed
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.curve import socket_keys
from spmd_runtime.protocol.messages import (
    DECODE_ERRORS,
    EndJob,
    NodeHeartbeat,
    StartWorkers,
    WorkersLost,
    launcher_inbound_decoder,
)
from spmd_runtime.protocol.transport import Encoder, make_socket

log = logging.getLogger("spmd.launch")

HEARTBEAT_INTERVAL_S = 1.0


class NodeAgent:
    def __init__(self, config: EngineConfig, supervisor: Supervisor, generation: int) -> None:
        self.config = config
        self.supervisor = supervisor
        self.generation = generation          # -1: none started yet
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="node agent")
        self._thread.start()

    def worker_exited(self, child: Child, code: int) -> bool:
        """Supervisor.on_exit: report a dead worker to node 0 and forget it (True: dealt
        with). Code 0 is a worker that node 0 shut down: the job is over."""
        if not child.name.startswith("worker") or code == 0:
            return False
        reason = child.describe(code)
        log.error("%s; node 0 decides whether the whole group restarts", reason)
        self._outbox.put(WorkersLost(generation=self.generation, reason=reason,
                                     node_rank=self.config.node_rank))
        self.supervisor.remove(lambda name: name == child.name)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        ctx = zmq.Context()
        address = self.config.worker_address
        sock = make_socket(ctx, zmq.DEALER, address, bind=False,
                           identity=f"node-{self.config.node_rank}".encode(),
                           curve=socket_keys(self.config.curve_keys, address, server=False))
        try:
            self._serve(sock)
        except Exception as error:          # never silently: the job would hang on this node
            log.exception("node agent failed")
            self.supervisor.job_ended = f"node {self.config.node_rank}'s agent failed: {error}"
        finally:
            sock.close(linger=0)
            ctx.term()

    def _serve(self, sock: zmq.Socket) -> None:
        encoder, decoder = Encoder(), launcher_inbound_decoder()
        last_beat, last_heard = 0.0, time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_INTERVAL_S:
                self._outbox.put(NodeHeartbeat(node_rank=self.config.node_rank,
                                               generation=self.generation))
                last_beat = now
            while not self._outbox.empty():
                try:
                    sock.send_multipart(framed(self.config.auth_token,
                                               encoder.encode(self._outbox.get())), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass                    # cut off: the next heartbeat says it all again
            if sock.poll(200, zmq.POLLIN):
                last_heard = time.monotonic()
                try:
                    message = decoder.decode(sock.recv_multipart()[-1])
                except DECODE_ERRORS:
                    continue
                if isinstance(message, StartWorkers):
                    self._replace_workers(message)
                elif isinstance(message, EndJob):
                    self.supervisor.job_ended = f"node 0 ended the job: {message.reason}"
                    return
            elif time.monotonic() - last_heard > self.config.rejoin_timeout_s:
                self.supervisor.job_ended = (
                    f"node 0 ({self.config.master_addr}) was silent for "
                    f"{self.config.rejoin_timeout_s:g}s (--rejoin-timeout-s)")
                return

    def _replace_workers(self, order: StartWorkers) -> None:
        if order.generation == self.generation:
            return
        with self.supervisor.lock:
            self.supervisor.remove(lambda name: name.startswith("worker"))
            start_workers(self.config, self.supervisor, order.generation,
                          master_port=order.master_port)
            self.generation = order.generation
        log.warning("node %d: workers of generation %d started (master port %d)",
                    self.config.node_rank, order.generation, order.master_port)
