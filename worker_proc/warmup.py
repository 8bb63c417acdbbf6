"""Warmup of the scheduler's buckets before serving: compile the layer pieces, run every
bucket shape once, and on CUDA capture graphs of as many as the memory reserved holds."""
from __future__ import annotations

import logging
import time

from spmd_runtime.protocol.buckets import PhaseBuckets, compiling, format_bytes
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.step_shape import Phase
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.graphs import GraphCapturer
from spmd_runtime.worker_proc.kv_cache import free_memory
from spmd_runtime.worker_proc.model_runner import ModelRunner

log = logging.getLogger("spmd.worker")


def prepare_buckets(runner: ModelRunner, config: EngineConfig,
                    buckets: dict[Phase, PhaseBuckets] | None, ctx: DistributedContext,
                    graph_budget: int | None = None) -> None:
    """With the scheduler's buckets (None: bucketing is off): log them, compile the layer
    pieces (--execution-mode compiled, on CPU), warm every bucket shape up and (graph_budget
    not None: on CUDA) capture graphs of as many buckets as the budget holds, so that serving
    compiles and captures nothing."""
    if buckets is None:
        return
    # Once per node, so that every node's log shows the buckets it runs.
    if ctx.local_rank == 0:
        for phase_buckets in buckets.values():
            log.info("%s", phase_buckets.config_line())
            if not phase_buckets.packed:
                log.info("%s", phase_buckets.list_line())
    if compiling(config, ctx.device.type):
        runner.graph_runner.compile_pieces(sum(len(b.buckets) for b in buckets.values()))
    if config.skip_warmup:
        log.warning("warmup skipped (--skip-warmup): the first batch of each bucket shape will "
                    "pay for its compilation while serving")
        runner.graph_runner.warmed_up = True
        return
    started = time.perf_counter()
    runner.graph_runner.warmup(buckets, lambda: free_memory(ctx.device, 1), config.max_num_batched_tokens)
    if graph_budget is not None:
        capture_graphs(runner, config, buckets, graph_budget, ctx)
    log.info("rank %d warmup finished in %.1fs", ctx.rank, time.perf_counter() - started)


def capture_graphs(runner: ModelRunner, config: EngineConfig,
                   buckets: dict[Phase, PhaseBuckets], budget: int,
                   ctx: DistributedContext) -> None:
    """CUDA graphs of the buckets within the memory reserved for them before the KV cache was
    sized (or, with the cache sized by hand, that share of what is free now)."""
    free_now = free_memory(ctx.device, 1)
    if not budget:
        budget = int(free_now * config.graph_reserved_mem)
    prompt = int(budget * config.graph_prompt_ratio)
    log.info("Using %s/%s of free device memory for graphs, %s for prompt and %s for decode "
             "(graph_prompt_ratio=%g)", format_bytes(budget), format_bytes(free_now),
             format_bytes(prompt), format_bytes(budget - prompt), config.graph_prompt_ratio)
    runner.graph_runner.capture_graphs(buckets, budget, config.graph_prompt_ratio,
                          {Phase.PROMPT: config.graph_prompt_strategy,
                           Phase.DECODE: config.graph_decode_strategy},
                          lambda: free_memory(ctx.device, 1), GraphCapturer(ctx.device))
