"""The messages of a multi-node job's control plane (launchers, their workers' liveness and
the scheduler's orders to them), and the base every tagged message shares; protocol.messages
re-exports them with its decoders."""
from __future__ import annotations

import msgspec


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True,
            forbid_unknown_fields=True):
    """Base of every tagged message: compact positional encoding, no GC tracking."""


class WorkersLost(_Wire, tag="workers_lost"):
    """From a launcher: one of its workers died. Single node: unless final, it has killed the
    rest of its worker group and started generation `generation`, which will report ready.
    Multi-node: `generation` is the one that lost a worker on node `node_rank`; the scheduler
    decides whether every node restarts (StartWorkers)."""

    generation: int
    reason: str
    final: bool = False
    node_rank: int = 0


class NodeHeartbeat(_Wire, tag="node_heartbeat"):
    """From each launcher of a multi-node job, every second: the node lives, and runs this
    generation of workers (-1: none yet, as a node that just (re)joined)."""

    node_rank: int
    generation: int


class WorkerAlive(_Wire, tag="worker_alive"):
    """From a worker of a multi-node job, every second, from a thread of its own: a frozen
    worker (stopped, or stuck with the interpreter held) goes silent."""

    rank: int
    generation: int


class StartWorkers(_Wire, tag="start_workers"):
    """To a launcher: replace this node's workers by generation `generation`, meeting at the
    master's `master_port`."""

    generation: int
    master_port: int


class EndJob(_Wire, tag="end_job"):
    """To every launcher: the job has failed and ends; stop everything and exit."""

    reason: str
