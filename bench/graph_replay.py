"""Decode step time, eager vs CUDA graph replay, per batch size, and the graphs' memory.

Builds the model runner in process (no scheduler, no sockets), prefills `batch` requests of
`--context` tokens, then times decode steps of one bucket (batch, context rounded up) run
eagerly, captures that bucket's graph and times the same steps replayed. Each step includes
the runner's input preparation and sampling, as when serving, one step at a time.

Then the graph steps again, overlapped as the worker runs them with --step-pipelining
overlap: each step prepared and launched before the one before it is finished, its inputs taking that
step's tokens on the device. The profile of those steps: wall time per step, the host's input
preparation, the device's time per step and its idle time between steps (CUDA events), and
the idle fraction.

    python bench/graph_replay.py --model dummy:llama-3.2-1b --dtype bfloat16 --batches 1,8,64,256

On CPU there is nothing to capture: `--emulate` runs the graph path's static-input staging
eagerly instead (a smoke test of this script, not a figure).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from spmd_runtime.protocol.buckets import BucketRange, PhaseBuckets, format_bytes
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.graphs import GraphCapturer
from spmd_runtime.worker_proc.kv_cache import free_memory
from spmd_runtime.worker_proc.worker import build_runner

PARAMS = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


class Bench:
    def __init__(self, runner, block_size: int, vocab: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.vocab = vocab
        self.step_id = 0
        self.generator = torch.Generator().manual_seed(0)

    def plan(self, **fields) -> StepPlan:
        fields.setdefault("new_requests", [])
        fields.setdefault("cached_request_ids", [])
        fields.setdefault("cached_num_scheduled_tokens", [])
        fields.setdefault("cached_new_block_ids", [])
        self.step_id += 1
        return StepPlan(step_id=self.step_id, **fields)

    def prefill(self, batch: int, context: int, blocks_per_request: int, chunk: int) -> list[int]:
        """`batch` requests of `context` prompt tokens, prefilled `chunk` tokens at a time."""
        ids = list(range(batch))
        for rid in ids:
            tokens = torch.randint(0, self.vocab, (context,), generator=self.generator).tolist()
            blocks = list(range(rid * blocks_per_request, (rid + 1) * blocks_per_request))
            first = min(chunk, context)
            self.runner.execute(self.plan(new_requests=[
                NewRequestData(rid, tokens, blocks, 0, first, PARAMS)]))
            for done in range(first, context, chunk):
                self.runner.execute(self.plan(cached_request_ids=[rid],
                                              cached_num_scheduled_tokens=[min(chunk, context - done)],
                                              cached_new_block_ids=[[]]))
        return ids

    def decode_ms(self, ids: list[int], bucket: StepShape, steps: int, sync) -> list[float]:
        times = []
        for _ in range(steps):
            sync()
            started = time.perf_counter()
            self.runner.execute(self.plan(cached_request_ids=ids,
                                          cached_num_scheduled_tokens=[1] * len(ids),
                                          cached_new_block_ids=[[] for _ in ids],
                                          bucket=bucket))
            sync()
            times.append((time.perf_counter() - started) * 1e3)
        return times

    def overlapped(self, ids: list[int], bucket: StepShape, steps: int, sync) -> dict:
        """`steps` decode steps, each launched before the one before it is finished."""
        outputs, in_flight = [], None
        sync()
        started = time.perf_counter()
        for _ in range(steps):
            prepared = self.runner.prepare(self.plan(
                cached_request_ids=ids, cached_num_scheduled_tokens=[1] * len(ids),
                cached_new_block_ids=[[] for _ in ids], bucket=bucket))
            launched = self.runner.launch(prepared, in_flight)
            if in_flight is not None:
                outputs.append(self.runner.finish(in_flight))
            in_flight = launched
        outputs.append(self.runner.finish(in_flight))
        wall_ms = (time.perf_counter() - started) * 1e3
        steady = outputs[1:]        # the first has no step before it to overlap with
        device = sum(o.forward_ms for o in steady)
        idle = sum(o.idle_ms or 0.0 for o in steady)
        return {"overlap_step_ms": wall_ms / steps,
                "prepare_ms": statistics.median(o.prepare_ms for o in outputs),
                "device_ms": statistics.median(o.forward_ms for o in steady),
                "idle_ms": statistics.median(o.idle_ms or 0.0 for o in steady),
                "idle_fraction": idle / (device + idle) if device + idle else 0.0}

    def op_table(self, ids: list[int], bucket: StepShape, steps: int, sync, rows: int) -> str:
        """torch's profiler over `steps` eager decode steps: the ops that took the device's
        (or, on CPU, the host's) time, most first."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            self.decode_ms(ids, bucket, steps, sync)
        key = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=rows)

    def drop(self, ids: list[int]) -> None:
        self.runner.execute(self.plan(dropped_request_ids=ids))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3.2-1b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--emulate", action="store_true",
                        help="no CUDA: time the graph path's staging run eagerly (smoke test)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--op-table", type=int, default=0, metavar="ROWS",
                        help="also profile --steps eager decode steps of each batch with torch's "
                             "profiler and print its ROWS costliest ops (by device time)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    block_size = 16
    steps_total = args.warmup_steps * 2 + args.steps * (4 if args.op_table else 3)
    context_bucket = -(-(args.context + steps_total + 1) // block_size) * block_size
    blocks_per_request = context_bucket // block_size
    config = EngineConfig(model=args.model, dtype=args.dtype, device=device.type,
                          block_size=block_size, execution_mode="eager",
                          num_kv_blocks=max(batches) * blocks_per_request,
                          max_num_batched_tokens=2048, max_num_seqs=max(batches),
                          max_model_len=context_bucket)
    ctx = DistributedContext(rank=0, local_rank=0, world_size=1, device=device, backend="gloo")
    runner, ready = build_runner(config, ctx)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    bench = Bench(runner, block_size, ready.vocab_size)
    # One capturer throughout: each batch's graphs are dropped before the next batch's are
    # captured, into a new pool then (a pool whose graphs are all gone takes no more captures).
    capturer = GraphCapturer(device, emulate=args.emulate or device.type != "cuda")
    rows = []
    for batch in sorted(batches, reverse=True):
        ids = bench.prefill(batch, args.context, blocks_per_request, config.max_num_batched_tokens)
        bucket = StepShape(Phase.DECODE, batch, context_bucket)
        bench.decode_ms(ids, bucket, args.warmup_steps, sync)
        eager = bench.decode_ms(ids, bucket, args.steps, sync)
        if args.op_table:
            print(f"batch {batch} eager decode, {args.steps} steps, by op:\n"
                  + bench.op_table(ids, bucket, args.steps, sync, args.op_table), flush=True)
        buckets = {Phase.DECODE: PhaseBuckets(Phase.DECODE, BucketRange(batch, batch, batch),
                                              BucketRange(context_bucket, context_bucket,
                                                          context_bucket),
                                              ((batch, context_bucket),))}
        report = runner.graph_runner.capture_graphs(buckets, 1 << 50, 0.0, {Phase.PROMPT: "min_tokens",
                                                               Phase.DECODE: "max_bs"},
                                       lambda: free_memory(device, 1), capturer)[Phase.DECODE]
        bench.decode_ms(ids, bucket, args.warmup_steps, sync)
        graphed = bench.decode_ms(ids, bucket, args.steps, sync)
        profile = bench.overlapped(ids, bucket, args.steps, sync)
        runner.graphs.clear()
        bench.drop(ids)
        row = {"batch": batch, "context_bucket": context_bucket,
               "eager_ms": statistics.median(eager), "graph_ms": statistics.median(graphed),
               "graph_mem_bytes": report.used_bytes}
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
        row.update(profile)
        rows.append(row)
        print(f"batch {batch:4d} ctx {context_bucket}: eager {row['eager_ms']:8.2f} ms  graph "
              f"{row['graph_ms']:8.2f} ms  x{row['speedup']:.2f}  graph memory "
              f"{format_bytes(report.used_bytes)}", flush=True)
        print(f"    overlapped graph steps: {row['overlap_step_ms']:8.2f} ms/step; host input "
              f"prep {row['prepare_ms']:.2f} ms, device {row['device_ms']:.2f} ms and idle "
              f"{row['idle_ms']:.3f} ms per step: device idle {row['idle_fraction']:.1%}",
              flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {args.model} {ready.device} {name} dtype={args.dtype}"
          f"{' (emulated graphs)' if capturer.emulate else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
