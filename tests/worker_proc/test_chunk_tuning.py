"""--row-parallel-chunks auto (worker_proc/chunk_tuning.py): the choice from a timing table,
and a real two-rank measurement where both ranks end with the same setting."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spmd_runtime.runtime.layers.parallel import TensorParallel
from spmd_runtime.worker_proc.chunk_tuning import choose, tune_row_parallel_chunks


def test_chunking_is_kept_only_where_it_wins_at_every_larger_size() -> None:
    never = {256: {1: 1.0, 2: 1.1, 4: 1.2}, 1024: {1: 4.0, 2: 3.9, 4: 4.5}}
    assert choose(never) == (1, 0), "3.9 vs 4.0 is within the margin: off"
    large = {256: {1: 1.0, 2: 1.3, 4: 1.4}, 1024: {1: 4.0, 2: 3.0, 4: 3.5},
             4096: {1: 16.0, 2: 12.0, 4: 10.0}}
    assert choose(large) == (4, 1024)
    # A win at a small size alone, lost at the largest, is not a threshold.
    small_only = {256: {1: 1.0, 2: 0.5, 4: 0.6}, 1024: {1: 4.0, 2: 5.0, 4: 5.0}}
    assert choose(small_only) == (1, 0)


def _tune(rank: int, size: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        tp = tune_row_parallel_chunks(TensorParallel(rank, size), 64, 96, torch.float32,
                                      torch.device("cpu"), max_tokens=1024)
        results.put((rank, tp.row_parallel_chunks, tp.row_parallel_chunk_threshold))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_rank_picks_the_same_setting() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_tune, args=(2, port, results), nprocs=2, start_method="spawn")
    found = sorted(results.get() for _ in range(2))
    assert [rank for rank, *_ in found] == [0, 1]
    assert found[0][1:] == found[1][1:]
    assert found[0][1] in (1, 2, 4)
