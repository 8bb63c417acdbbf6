"""--row-parallel-chunks auto: time the MLP's row-parallel layer (its shapes, this group, this
link) at start-up with the input whole and split into chunks, and keep what was fastest.

Every rank runs the same collectives in the same order and the timings are all-reduced (the
slowest rank's), so all ranks pick the same setting. Chunking is kept only at the batch sizes
where it beat the unchunked layer by a margin, so turning it on is never slower than off by
more than the measurement's noise."""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch
import torch.distributed as dist
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.layers.parallel import TensorParallel, row_parallel_linear
from spmd_runtime.worker_proc.distributed import DistributedContext

log = logging.getLogger("spmd.worker")

CHUNK_COUNTS = (2, 4)
TOKEN_COUNTS = (256, 1024, 4096)
REPEATS = 7
MARGIN = 0.95          # chunking must take at most 95% of the unchunked time


def _time_layer(x: torch.Tensor, weight: torch.Tensor, setting: TensorParallel) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    started = time.perf_counter()
    row_parallel_linear(x, weight, None, setting)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - started


def measure(tp: TensorParallel, hidden: int, features: int, dtype: torch.dtype,
            device: torch.device, max_tokens: int) -> dict[int, dict[int, float]]:
    """Seconds per call (the group's slowest rank) by token count, then chunk count: the
    median of REPEATS calls, the chunk counts taking turns call by call, so a machine that
    slows down or speeds up during the measurement favours none of them."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(hidden, features, generator=generator) * 0.02).to(device, dtype)
    sizes = [n for n in TOKEN_COUNTS if n <= max_tokens] or [max_tokens]
    counts = (1, *CHUNK_COUNTS)
    settings = [dataclasses.replace(tp, row_parallel_chunks=c, row_parallel_chunk_threshold=0)
                for c in counts]
    table = torch.zeros(len(sizes), len(counts), dtype=torch.float64)
    for i, tokens in enumerate(sizes):
        x = torch.randn(tokens, features, generator=generator).to(device, dtype)
        for setting in settings:                                  # warm
            row_parallel_linear(x, weight, None, setting)
        times = [[_time_layer(x, weight, setting) for setting in settings]
                 for _ in range(REPEATS)]
        for j in range(len(counts)):
            table[i, j] = statistics.median(row[j] for row in times)
    reduced = table.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=tp.group)
    reduced = reduced.cpu()
    return {tokens: {chunks: float(reduced[i, j]) for j, chunks in enumerate(counts)}
            for i, tokens in enumerate(sizes)}


def choose(timings: dict[int, dict[int, float]]) -> tuple[int, int]:
    """(chunks, threshold): chunking from the smallest token count from which it wins at every
    larger one measured, with the chunk count best at the largest; (1, 0) when it never wins."""
    sizes = sorted(timings)
    threshold = None
    for tokens in reversed(sizes):
        best = min(CHUNK_COUNTS, key=lambda c: timings[tokens][c])
        if timings[tokens][best] > MARGIN * timings[tokens][1]:
            break
        threshold = tokens
    if threshold is None:
        return 1, 0
    largest = timings[sizes[-1]]
    return min(CHUNK_COUNTS, key=lambda c: largest[c]), threshold


def tune_row_parallel_chunks(tp: TensorParallel, hidden: int, features: int,
                             dtype: torch.dtype, device: torch.device,
                             max_tokens: int) -> TensorParallel:
    if tp.size == 1:
        return dataclasses.replace(tp, row_parallel_chunks=1)
    timings = measure(tp, hidden, features, dtype, device, max_tokens)
    chunks, threshold = choose(timings)
    table = "; ".join(f"{tokens} tokens: " + ", ".join(
        f"{c} chunk{'s' if c > 1 else ''} {t * 1e3:.2f} ms" for c, t in row.items())
        for tokens, row in timings.items())
    if chunks == 1:
        log.info("rank %d: row-parallel chunking auto: off (never faster here: %s)", tp.rank,
                 table)
        return dataclasses.replace(tp, row_parallel_chunks=1)
    log.info("rank %d: row-parallel chunking auto: %d chunks from %d tokens (%s)", tp.rank,
             chunks, threshold, table)
    return dataclasses.replace(tp, row_parallel_chunks=chunks,
                               row_parallel_chunk_threshold=threshold)


def tensor_parallel(config: EngineConfig, ctx: DistributedContext) -> TensorParallel:
    """Every worker of the job is one rank of a single tensor-parallel group; with auto, its
    chunking is decided once the model's shapes are known (tuned_if_asked)."""
    chunks = config.row_parallel_chunks
    if chunks == "auto":
        chunks = 1
    threshold = config.row_parallel_chunk_threshold
    return TensorParallel(rank=ctx.rank, size=ctx.world_size, row_parallel_chunks=chunks,
                          row_parallel_chunk_threshold=threshold)


def tuned_if_asked(config: EngineConfig, tp: TensorParallel, model: ModelConfig,
                   dtype: torch.dtype, device: torch.device) -> TensorParallel:
    if config.row_parallel_chunks != "auto":
        return tp
    return tune_row_parallel_chunks(tp, model.hidden_size, model.intermediate_size // tp.size,
                                    dtype, device, config.max_num_batched_tokens)
