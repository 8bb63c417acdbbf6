"""Process-group set-up: backend choice and a clear error when the master cannot be reached."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from spmd_runtime.protocol.transport import free_tcp_port
from spmd_runtime.worker_proc.distributed import pick_backend, pick_device

CPU = torch.device("cpu")


def test_auto_picks_gloo_on_cpu_without_habana() -> None:
    assert pick_backend("auto", CPU) == "gloo"
    assert pick_backend("gloo", CPU) == "gloo"


def test_unavailable_backends_are_refused_with_what_to_use() -> None:
    with pytest.raises(ValueError, match="nccl"):
        pick_backend("nccl", CPU)
    with pytest.raises(ValueError, match="unknown --dist-backend"):
        pick_backend("mpi-ish", CPU)


def test_each_local_rank_gets_a_cuda_device_of_its_own(monkeypatch) -> None:
    """On a one-GPU node a second local rank is refused, naming what to change, before NCCL
    fails at its first collective ("Duplicate GPU detected")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto", 0) == torch.device("cuda", 0)
    assert pick_device("cuda", 0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"local rank 1 .* shows 1 .*--nproc-per-node.*--device cpu"):
        pick_device("auto", 1)
    assert pick_device("cpu", 1) == CPU


@pytest.mark.timeout(120)
def test_a_worker_that_cannot_reach_the_master_exits_with_a_clear_message() -> None:
    env = dict(os.environ, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_tcp_port()))
    code = ("from spmd_runtime.worker_proc.distributed import init_distributed\n"
            "init_distributed('cpu', 'gloo', timeout_s=3)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=90, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))))
    assert done.returncode != 0
    assert "could not join the 2-rank process group at 127.0.0.1:" in done.stderr, done.stderr
    assert "--master-addr" in done.stderr
