"""Scheduler overhead per step, and the padding of bucketed steps, with a fake worker.

Two modes. Without --workload: 256 running decode requests, prefix caching on; times schedule
+ encode the plan + maintain + decode the result + update, and reports the plan's bytes per
decode request (issue 3):

    python bench/scheduler_overhead.py --num-requests 256 --steps 200

With --workload (a preset of `spmdrun bench throughput`): the scheduler is built as the server
builds it for a GPU engine (its configuration, the buckets a CUDA worker with the Triton kernel
is sent, a roomy KV pool) and serves the whole workload against a fake worker that answers
each step after --step-ms. It prints the padding of the bucketed steps (padding_waste: padded
tokens per computed token) and the host time per step at full batch (host_ms_per_step: the
scheduler's own work, timed apart from the fake step: what a GPU engine's host adds per step):

    python bench/scheduler_overhead.py --workload issue10 --json

--buckets padded shows the buckets the engine had before packing (prompts padded to (batch,
length) buckets, decodes to (batch, context) ones) on the same workload.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from spmd_runtime.launch.bench import THROUGHPUT_WORKLOADS, ThroughputWorkload
from spmd_runtime.protocol.buckets import PHASES, PhaseBuckets, default_ranges
from spmd_runtime.protocol.config import EngineConfig, with_step_budget
from spmd_runtime.protocol.messages import StepResult, WorkerLoaded, scheduler_inbound_decoder
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import Phase
from spmd_runtime.protocol.transport import Encoder
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.request import Request
from spmd_runtime.scheduler_proc.scheduler import Scheduler
from spmd_runtime.scheduler_proc.server import freeze_long_lived
from spmd_runtime.scheduler_proc.startup import derive_warmup_plan

EOS = 2
# Issue 10's GPU run: spmdrun bench throughput --workload issue10 ... (docs/BENCHMARKS.md).
GPU_ENGINE = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2176,
                  device="cuda", execution_mode="compiled")


def fake_result(step, rng: random.Random, scheduler: Scheduler | None = None) -> StepResult:
    """What rank 0 would answer: a token for every request whose scheduled tokens reach the
    end of its known tokens (a prefill chunk short of it samples nothing)."""
    ids = [rid for rid, n in step.num_scheduled.items()
           if scheduler is None or scheduler.requests[rid].num_computed_tokens + n
           >= scheduler.requests[rid].num_tokens]
    return StepResult(step_id=step.plan.step_id, request_ids=ids,
                      sampled_token_ids=[rng.randrange(1000, 40000) for _ in ids],
                      forward_ms=0.0, prepare_ms=0.0)


def gpu_buckets(config: EngineConfig, layout: str) -> dict[Phase, PhaseBuckets]:
    """What the scheduler sends a CUDA worker whose attention reads context lengths (packed),
    or the (batch, length) and (batch, context) buckets of before (padded)."""
    if layout == "packed":
        loaded = WorkerLoaded(rank=0, max_model_len=config.max_model_len, device="cuda:0",
                              context_from_tensors=True)
        return derive_warmup_plan(config, loaded).buckets
    buckets = {}
    for phase in PHASES:
        ranges = default_ranges(phase, max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.max_num_batched_tokens,
                                max_model_len=config.max_model_len, block_size=config.block_size)
        buckets[phase] = PhaseBuckets.generate(phase, ranges["bs"], ranges["seq"],
                                               config.max_num_batched_tokens)
    return buckets


def serve_workload(workload: ThroughputWorkload, config: EngineConfig,
                   buckets: dict[Phase, PhaseBuckets], step_ms: float = 0.0) -> dict:
    """Serve every request of the workload to its end; the padding and host-time figures."""
    rng = random.Random(workload.seed)
    blocks_per_request = -(-config.max_model_len // config.block_size)
    kv = KVCacheManager(workload.num_requests * blocks_per_request + 1, config.block_size,
                        enable_caching=config.enable_prefix_caching)
    scheduler = Scheduler(kv, max_num_batched_tokens=config.max_num_batched_tokens,
                          max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                          eos_token_ids=[EOS], policy=config.scheduler, buckets=buckets)
    for request_id, (prompt, output_len) in enumerate(zip(
            workload.prompts(32000), workload.output_lens(), strict=True)):
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        scheduler.add(Request(request_id, prompt, params))
    freeze_long_lived()                    # as the server does once it is built
    encoder, decoder = Encoder(), scheduler_inbound_decoder()
    full_batch_ms, all_ms, steps = [], [], 0
    while scheduler.has_work:
        started = time.perf_counter()
        step = scheduler.schedule()
        encoder.encode(step.plan)
        scheduler.maintain(step)
        host = time.perf_counter() - started
        result = encoder.encode(fake_result(step, rng, scheduler))
        if step_ms:
            time.sleep(step_ms / 1e3)      # the fake worker's step, not timed as host work
        started = time.perf_counter()
        scheduler.update(step, decoder.decode(result))
        host += time.perf_counter() - started
        steps += 1
        all_ms.append(host * 1e3)
        if len(step.num_scheduled) >= config.max_num_seqs:
            full_batch_ms.append(host * 1e3)
    counters = scheduler.planner.counters
    return {"workload": workload.describe(), "steps": steps,
            "padding_waste": round(counters.padding_waste, 4),
            "padded_tokens": counters.padded_tokens, "computed_tokens": counters.computed_tokens,
            "batches_outside_buckets": counters.batches_outside_buckets,
            "num_buckets": {p: len(b.buckets) for p, b in buckets.items()},
            "packed_phases": [p for p, b in buckets.items() if b.packed],
            "full_batch_steps": len(full_batch_ms),
            "host_ms_per_step": round(statistics.mean(full_batch_ms), 3) if full_batch_ms else None,
            "host_ms_per_step_p50": round(statistics.median(full_batch_ms), 3)
            if full_batch_ms else None,
            "host_ms_per_step_all": round(statistics.mean(all_ms), 3)}


def decode_overhead(args: argparse.Namespace) -> int:
    """Issue 3's figure: every request running, decode steps only, no buckets."""
    rng = random.Random(0)
    blocks_per_request = (args.prompt_len + args.steps + 64) // args.block_size + 1
    kv = KVCacheManager(args.num_requests * blocks_per_request, args.block_size, enable_caching=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=args.num_requests * args.prompt_len,
                          max_num_seqs=args.num_requests, max_model_len=8192, eos_token_ids=[EOS])
    params = SamplingParams(max_tokens=args.steps + 100, temperature=0.0, ignore_eos=True)
    for request_id in range(args.num_requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
        scheduler.add(Request(request_id, prompt, params))
    encoder = Encoder()
    decoder = scheduler_inbound_decoder()

    def one_step() -> tuple[float, int, int]:
        started = time.perf_counter()
        step = scheduler.schedule()
        payload = encoder.encode(step.plan)
        scheduler.maintain(step)
        result = decoder.decode(encoder.encode(fake_result(step, rng)))
        scheduler.update(step, result)
        return time.perf_counter() - started, len(payload), len(step.plan.new_requests)

    one_step()  # admits every request (the prefill step)
    timings, sizes = [], []
    for _ in range(args.steps):
        elapsed, size, new = one_step()
        assert new == 0 and len(scheduler.running) == args.num_requests
        timings.append(elapsed * 1e3)
        sizes.append(size)
    per_request = statistics.mean(sizes) / args.num_requests
    print(f"{'decode requests':>16} {'steps':>6} {'ms/step p50':>12} {'ms/step mean':>13} "
          f"{'ms/step p99':>12} {'plan bytes/request':>19}")
    timings.sort()
    print(f"{args.num_requests:>16} {args.steps:>6} {statistics.median(timings):>12.3f} "
          f"{statistics.mean(timings):>13.3f} {timings[int(len(timings) * 0.99) - 1]:>12.3f} "
          f"{per_request:>19.2f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=tuple(THROUGHPUT_WORKLOADS),
                        help="serve this preset to its end against a fake GPU worker")
    parser.add_argument("--buckets", choices=("packed", "padded"), default="packed",
                        help="with --workload: the engine's buckets (packed) or those of before")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="with --workload: the fake worker's step time (default: 0)")
    parser.add_argument("--json", action="store_true", help="with --workload: print JSON")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if args.workload is None:
        return decode_overhead(args)
    config = with_step_budget(EngineConfig(model="unused", block_size=args.block_size, **GPU_ENGINE),
                              "cuda")
    report = serve_workload(THROUGHPUT_WORKLOADS[args.workload], config,
                            gpu_buckets(config, args.buckets), args.step_ms)
    report["buckets"] = args.buckets
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
