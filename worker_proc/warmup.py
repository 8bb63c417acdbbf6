"""Warmup before serving: of the scheduler's buckets (compile the layer pieces, run every
bucket shape once, and on CUDA capture graphs of as many as the memory reserved holds), or,
where a CPU worker serves unpadded steps, of its kernels with one short prompt."""
from __future__ import annotations

import logging
import time

from spmd_runtime.protocol.buckets import PhaseBuckets, compiling, format_bytes
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import Phase
from spmd_runtime.runtime.layers.linear import weight_parameters
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.graphs import GraphCapturer
from spmd_runtime.worker_proc.kv_cache import free_memory
from spmd_runtime.worker_proc.model_runner import ModelRunner

log = logging.getLogger("spmd.worker")

# The unpadded CPU warm-up's prompt: at most this many tokens, and at most WARMUP_FLOPS of
# work (~0.2 s of 2 cores: SmolLM2 512 tokens, a 1B model ~80, an 8B one 12). The first step of
# a fresh process otherwise pays for first use (the kernels' code pages, malloc growing its heap
# for the big temporaries): SmolLM2's 512-token prompt took ~7 ms longer as a process's first
# step, ~2 ms after a warm-up (2 Zen 5 cores).
WARMUP_PROMPT_TOKENS = 512
WARMUP_FLOPS = 2e11
# Not an id the scheduler hands out (those count up from 0).
WARMUP_REQUEST_ID = -1


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


def warm_up_unpadded(runner: ModelRunner, config: EngineConfig, num_blocks: int,
                     max_model_len: int, vocab_size: int, ctx: DistributedContext) -> None:
    """A CPU worker without buckets (or drafter, or windowed pool) runs one short greedy prompt
    through its runner, in the pool's first blocks (no request holds them yet; the scheduler
    never reads a block it has not had written), then forgets it. Every rank runs the same
    plan, so tensor-parallel collectives pair up. --skip-warmup skips it."""
    if ctx.device.type != "cpu" or config.skip_warmup or runner.drafter is not None or \
            runner.sliding_tables is not None:
        return
    by_work = int(WARMUP_FLOPS / (2 * max(1, weight_parameters(runner.model) * ctx.world_size)))
    tokens = min(WARMUP_PROMPT_TOKENS, by_work, max_model_len - 1,
                 num_blocks * config.block_size - 1)
    if tokens < 1:
        return
    started = time.perf_counter()
    blocks = list(range(-(-(tokens + 1) // config.block_size)))
    prompt = [i % vocab_size for i in range(tokens)]
    request = NewRequestData(WARMUP_REQUEST_ID, prompt, blocks, 0, tokens,
                             SamplingParams(max_tokens=1, temperature=0.0))
    runner.execute(StepPlan(-2, [request], [], [], []))
    runner.execute(StepPlan(-1, [], [], [], [], dropped_request_ids=[WARMUP_REQUEST_ID]))
    log.info("rank %d warm-up: a %d-token prompt in %.2fs", ctx.rank, tokens,
             time.perf_counter() - started)
