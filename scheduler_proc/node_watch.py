"""Multi-node jobs, seen from node 0's scheduler: every launcher and every worker beats once a
second; one that goes silent past --heartbeat-timeout-s (a node killed, its link cut, a worker
frozen) or a launcher reporting a dead worker makes the whole group restart on every node, as
torchrun's elastic agent restarts a group: each launcher is told the new generation and the
master port it meets on. A node that comes back (or is replaced) catches up by its next
heartbeat; one that stays away past --rejoin-timeout-s ends the job."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import (
    EndJob,
    NodeHeartbeat,
    StartWorkers,
    WorkerAlive,
    WorkersLost,
)
from spmd_runtime.protocol.transport import Encoder, free_tcp_port

log = logging.getLogger("spmd.scheduler")

RESTART_WINDOW_S = 3600.0
# How often a node that runs an old generation is told the current one again.
OFFER_INTERVAL_S = 2.0


def node_identity(node_rank: int) -> bytes:
    return f"node-{node_rank}".encode()


class NodeWatch:
    def __init__(self, config: EngineConfig, encoder: Encoder,
                 send: Callable[[bytes, bytes], None]) -> None:
        self.config = config
        self.encoder = encoder
        self._send = send
        self.generation = 0
        self.master_port = config.master_port
        self.started = time.monotonic()
        self.node_heard: dict[int, float] = {}
        self.node_generation: dict[int, int] = {}
        # Workers of the current generation: when each was last heard.
        self.rank_heard: dict[int, float] = {}
        self.restarts: list[float] = []
        self._offered: dict[int, float] = {}

    def heard(self, message: NodeHeartbeat | WorkerAlive) -> None:
        now = time.monotonic()
        if isinstance(message, WorkerAlive):
            if message.generation == self.generation:
                self.rank_heard[message.rank] = now
            return
        node = message.node_rank
        if node not in self.node_heard:
            log.info("node %d joined (running generation %d)", node, message.generation)
        self.node_heard[node] = now
        self.node_generation[node] = message.generation
        if message.generation < self.generation:     # -1: a node that has just (re)joined
            if now - self._offered.get(node, 0.0) > OFFER_INTERVAL_S:
                self._offered[node] = now
                self._start(node)

    def _start(self, node: int) -> None:
        self._send(node_identity(node), self.encoder.encode(
            StartWorkers(generation=self.generation, master_port=self.master_port)))

    def silent(self) -> str | None:
        """Why the group must restart now: a node of the current generation, or one of its
        workers, silent past --heartbeat-timeout-s; None while all beat."""
        now = time.monotonic()
        limit = self.config.heartbeat_timeout_s
        for node, heard in self.node_heard.items():
            if self.node_generation.get(node) == self.generation and now - heard > limit:
                return f"node {node} went silent ({now - heard:.1f}s without a heartbeat)"
        for rank, heard in self.rank_heard.items():
            if now - heard > limit:
                node = rank // self.config.nproc_per_node
                return (f"worker rank {rank} on node {node} went silent ({now - heard:.1f}s "
                        "without a heartbeat: frozen or cut off)")
        return None

    def missing(self) -> str | None:
        """A node away for longer than --rejoin-timeout-s (or never come at all), or None."""
        now = time.monotonic()
        limit = self.config.rejoin_timeout_s
        for node in range(self.config.nnodes):
            heard = self.node_heard.get(node, self.started)
            if now - heard > limit:
                return (f"node {node} did not come back within --rejoin-timeout-s {limit:g}s")
        return None

    def restart(self, reason: str) -> WorkersLost:
        """Every node restarts its workers as the next generation, unless --max-restarts in
        the last hour are spent (a final WorkersLost)."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if len(self.restarts) >= self.config.max_restarts:
            return WorkersLost(generation=self.generation, reason=(
                f"{reason}; restarts exhausted ({len(self.restarts)} in the last hour, "
                f"--max-restarts {self.config.max_restarts})"), final=True)
        self.restarts.append(now)
        self.generation += 1
        self.master_port = free_tcp_port(self.config.master_addr)
        self.rank_heard.clear()
        log.warning("%s: restarting the worker group on every node (generation %d, restart %d "
                    "of %d this hour)", reason, self.generation, len(self.restarts),
                    self.config.max_restarts)
        for node in self.node_heard:
            self._offered[node] = now
            self._start(node)
        return WorkersLost(generation=self.generation, reason=reason)

    def end_job(self, reason: str) -> None:
        for node in self.node_heard:
            self._send(node_identity(node), self.encoder.encode(EndJob(reason=reason)))
