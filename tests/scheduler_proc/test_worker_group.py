"""WorkerGroup's sends to workers that are gone (scheduler_proc/worker_group.py)."""
from __future__ import annotations

import pytest
import zmq
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.transport import Encoder
from spmd_runtime.scheduler_proc.worker_group import GroupLost, WorkerGroup, WorkersFailed


def group_of(tmp_path, ctx: zmq.Context, **options) -> WorkerGroup:
    config = EngineConfig(model="dummy:tiny-llama", worker_address=f"ipc://{tmp_path}/workers",
                          **options)
    return WorkerGroup(config, ctx, Encoder(), lambda: False)


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_across_nodes_an_unreachable_worker_restarts_the_group(tmp_path, max_restarts) -> None:
    """A job of 3 nodes whose rank 2 has no connection (its node was killed and ZeroMQ dropped
    the peer before the heartbeats lapsed): the group restarts as for a silent node, or, with no
    restarts left, the job ends naming the rank; it is not a failure of its own."""
    ctx = zmq.Context()
    group = group_of(tmp_path, ctx, nnodes=3, nproc_per_node=1, max_restarts=max_restarts)
    try:
        with pytest.raises(GroupLost) as lost:
            group.send_to(2, b"plan")
        message = lost.value.message
        assert "worker rank 2 is unreachable" in message.reason
        if max_restarts:
            assert not message.final and message.generation == 1
            group.lost(message)
            assert group.generation == 1
        else:
            assert message.final
            with pytest.raises(WorkersFailed, match="restarts exhausted"):
                group.lost(message)
    finally:
        group.close()
        ctx.term()


def test_on_one_node_an_unreachable_worker_fails_the_workers(tmp_path) -> None:
    ctx = zmq.Context()
    group = group_of(tmp_path, ctx)
    try:
        with pytest.raises(WorkersFailed, match="worker rank 0 is unreachable"):
            group.send_to(0, b"plan")
    finally:
        group.close()
        ctx.term()
