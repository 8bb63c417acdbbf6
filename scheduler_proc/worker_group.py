"""The scheduler's side of the worker group: its socket, start-up, heartbeats, and what its
launchers report when a worker dies."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
from spmd_runtime.protocol.auth import AuthRejected, checked_payload
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.curve import socket_keys
from spmd_runtime.protocol.messages import (
    Heartbeat,
    NodeHeartbeat,
    Shutdown,
    WarmupPlan,
    WorkerAlive,
    WorkerError,
    WorkerLoaded,
    WorkerReady,
    WorkersLost,
    scheduler_inbound_decoder,
)
from spmd_runtime.protocol.transport import Encoder, make_socket, poll_recv
from spmd_runtime.scheduler_proc.node_watch import NodeWatch, node_identity

log = logging.getLogger("spmd.scheduler")

READY_TIMEOUT_S = 900.0
HEARTBEAT_INTERVAL_S = 1.0
# After a worker reports an error, how long its launcher has to say whether it restarts the
# group (or, when it cannot, what died first: the error may only be a peer's broken collective).
LAUNCHER_GRACE_S = 20.0
LAUNCHER_GRACE_NO_RESTART_S = 2.0


class WorkersFailed(RuntimeError):
    """A worker reported an error or stopped answering; the engine cannot go on."""


class Stopping(Exception):
    """A stop was requested (SIGTERM/SIGINT) while waiting on the workers."""


class GroupLost(Exception):
    """A launcher reported a dead worker; a new generation of the group is starting."""

    def __init__(self, message: WorkersLost) -> None:
        super().__init__(message.reason)
        self.message = message


def worker_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class WorkerGroup:
    """The ROUTER socket the workers connect to, and the generation of the group behind it.

    `stopping` tells whether the scheduler was asked to stop, so waits on workers end."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context, encoder: Encoder,
                 stopping: Callable[[], bool]) -> None:
        self.config = config
        self.encoder = encoder
        self._is_stopping = stopping
        # A third of --heartbeat-timeout-s where that is under 3 s: a beat a second against a
        # 1-second timeout would leave the workers guessing.
        self.heartbeat_interval_s = min(HEARTBEAT_INTERVAL_S, config.heartbeat_timeout_s / 3)
        self.decoder = scheduler_inbound_decoder()
        self.socket = make_socket(ctx, zmq.ROUTER, config.worker_address, bind=True,
                                  curve=socket_keys(config.curve_keys, config.worker_address,
                                                    server=True))
        # A restarted worker reconnects with its rank's identity: it takes the old one over.
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.generation = 0
        # Across nodes, this process decides when the group restarts (see node_watch.py).
        self.nodes = (NodeWatch(config, encoder, self._send_to_node) if config.nnodes > 1
                      else None)
        # (deadline, error) once a worker failed and its launcher has not spoken yet.
        self._awaiting_launcher: tuple[float, WorkerError] | None = None
        self._last_sent = self._last_node_beat = 0.0

    def gather_ready(self, warmup_plan: Callable[[WorkerLoaded], WarmupPlan],
                     while_waiting: Callable[[], None] | None = None) -> dict[int, WorkerReady]:
        """Wait until every rank of the current generation reports ready, answering each rank
        that has loaded its model with `warmup_plan` (the buckets it warms up first).
        `while_waiting` runs between polls (after a restart: answer clients already connected,
        queue their requests)."""
        world = self.config.world_size
        ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < world:
            if time.monotonic() > deadline:
                raise WorkersFailed(f"only {len(ready)} of {world} workers became ready in "
                                    f"{READY_TIMEOUT_S:.0f}s")
            self.heartbeat_if_due()
            if while_waiting is not None:
                while_waiting()
            frames = poll_recv(self.socket,
                               0.05 if while_waiting is not None else self.heartbeat_interval_s)
            if self._is_stopping():
                raise WorkersFailed("stopped while waiting for workers")
            if self.nodes is not None and (missing := self.nodes.missing()):
                raise WorkersFailed(missing)
            if frames is None:
                continue
            message = self._decode(frames)
            if isinstance(message, (NodeHeartbeat, WorkerAlive)):
                self.nodes.heard(message)
            elif isinstance(message, WorkersLost):
                if self._stale(message):
                    continue
                self.lost(self._decide(message))    # a worker died during start-up
                ready.clear()
            elif isinstance(message, WorkerError) and message.generation == self.generation:
                raise WorkersFailed(f"worker rank {message.rank} failed to start:\n{message.message}")
            elif isinstance(message, WorkerLoaded) and message.generation == self.generation:
                self.send_to(message.rank, self.encoder.encode(warmup_plan(message)))
            elif isinstance(message, WorkerReady) and message.generation == self.generation:
                ready[message.rank] = message
                log.info("worker rank %d ready on %s with %d KV blocks", message.rank,
                         message.device, message.num_kv_blocks)
        return ready

    def lost(self, message: WorkersLost) -> None:
        """A launcher lost a worker: fail if it cannot restart the group, else expect the
        next generation."""
        self._awaiting_launcher = None
        if message.final:
            raise WorkersFailed(f"the engine is down: {message.reason}, and the worker group "
                                "is not restarted (restarts exhausted: --max-restarts)")
        if self.nodes is None:
            log.warning("%s: the launcher restarts the worker group (generation %d)",
                        message.reason, message.generation)
        self.generation = message.generation

    def _stale(self, message: WorkersLost) -> bool:
        """Across nodes: a report about a generation already replaced (a node cut off that
        speaks again)."""
        if self.nodes is None or message.generation >= self.generation:
            return False
        log.info("node %d reports a lost worker of generation %d, already replaced",
                 message.node_rank, message.generation)
        return True

    def _decide(self, message: WorkersLost) -> WorkersLost:
        """Single node, the launcher has decided; across nodes, this process does."""
        if self.nodes is None:
            return message
        return self.nodes.restart(f"node {message.node_rank}: {message.reason}")

    def poll(self, timeout_s: float):
        """The next worker message within timeout_s, or None (nothing, or a frame without the
        auth token when one is set)."""
        frames = poll_recv(self.socket, timeout_s)
        return None if frames is None else self._decode(frames)

    def _decode(self, frames: list[bytes]):
        try:
            payload = checked_payload(frames[1:], self.config.auth_token)
        except AuthRejected as error:
            log.warning("ignored a frame on the worker socket: %s", error)
            return None
        return self.decoder.decode(payload)

    def drain(self) -> None:
        """While idle: a launcher may report a dead worker, or a worker its own failure."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.control_message(self._decode(frames))

    def control_message(self, message) -> None:
        """Raises GroupLost when the group restarts; a worker's error starts the wait for its
        launcher."""
        if isinstance(message, (NodeHeartbeat, WorkerAlive)):
            self.nodes.heard(message)
            return
        if isinstance(message, WorkersLost):
            if not self._stale(message):
                raise GroupLost(self._decide(message))
            return
        if isinstance(message, WorkerError) and self._awaiting_launcher is None \
                and message.generation == self.generation:
            # The rank exits after this; its launcher then restarts the group or says it will
            # not, naming the worker that died first. That message decides.
            log.error("worker rank %d failed; waiting for its launcher:\n%s", message.rank,
                      message.message)
            grace = LAUNCHER_GRACE_S if self._restartable else LAUNCHER_GRACE_NO_RESTART_S
            self._awaiting_launcher = (time.monotonic() + grace, message)

    def check_awaiting_launcher(self) -> None:
        """Across nodes, a node or worker gone silent restarts the group (GroupLost). No
        launcher restarted the group after a worker failed (workers started by hand or by
        torchrun): the engine cannot go on."""
        if self.nodes is not None and (reason := self.nodes.silent()):
            raise GroupLost(self.nodes.restart(reason))
        if self._awaiting_launcher is not None and time.monotonic() > self._awaiting_launcher[0]:
            error = self._awaiting_launcher[1]
            raise WorkersFailed(f"worker rank {error.rank} failed:\n{error.message}")

    @property
    def _restartable(self) -> bool:
        return self.config.max_restarts > 0

    def heartbeat_if_due(self) -> None:
        """Workers exit when they hear nothing for --heartbeat-timeout-s: tell them we live
        (a plan sent counts). Ranks not connected yet are skipped. Launchers of other nodes
        hear it every second too."""
        now = time.monotonic()
        if self.nodes is not None and now - self._last_node_beat >= HEARTBEAT_INTERVAL_S:
            self._last_node_beat = now
            heartbeat = self.encoder.encode(Heartbeat())
            for node in self.nodes.node_heard:
                self._send_to_node(node_identity(node), heartbeat)
        if now - self._last_sent < self.heartbeat_interval_s:
            return
        self._send_without_waiting(self.encoder.encode(Heartbeat()))
        self._last_sent = time.monotonic()

    def broadcast(self, payload: bytes) -> None:
        self._last_sent = time.monotonic()
        for rank in range(self.config.world_size):
            self.send_to(rank, payload)

    def send_to(self, rank: int, payload: bytes) -> None:
        try:
            self.socket.send_multipart([worker_identity(rank), payload])
        except zmq.ZMQError as error:
            if self._is_stopping():
                raise Stopping() from None
            reason = f"worker rank {rank} is unreachable: {error}"
            if self.nodes is not None:
                # Across nodes a worker whose connection is gone (its node killed or cut off)
                # is what a silent node is, found sooner: ZeroMQ may drop the peer before its
                # heartbeats lapse. The group restarts (or, restarts spent, the job ends).
                raise GroupLost(self.nodes.restart(reason)) from None
            raise WorkersFailed(reason) from None

    def end_job(self, reason: str) -> None:
        """The job failed: every node's launcher stops its workers and exits."""
        if self.nodes is not None:
            self.nodes.end_job(reason)

    def _send_to_node(self, identity: bytes, payload: bytes) -> None:
        """To a launcher; one that is away gets the current generation when it is back."""
        try:
            self.socket.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def shutdown(self) -> None:
        self._send_without_waiting(self.encoder.encode(Shutdown(reason="scheduler stopping")))

    def _send_without_waiting(self, payload: bytes) -> None:
        """To every rank that can take it now; a rank that cannot is gone or not there yet."""
        for rank in range(self.config.world_size):
            try:
                self.socket.send_multipart([worker_identity(rank), payload], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self.socket.close(linger=0)
