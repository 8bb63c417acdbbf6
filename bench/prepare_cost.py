"""Host time a worker spends building one decode step's inputs, per attention path.

Builds a runner on a dummy model (its weights are never used), gives it `--batch` requests
with random contexts in [--context-min, --context-max], and times ModelRunner.prepare of a
decode step of all of them, padded to one decode bucket, as on a GPU with graphs:

    python bench/prepare_cost.py --batch 256 --context-min 100 --context-max 1024
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.runtime.layers.attention_backend import TORCH, TRITON
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.worker import build_runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context-min", type=int, default=100)
    parser.add_argument("--context-max", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    block_size = 16
    blocks = -(-(args.context_max + 64) // block_size)
    config = EngineConfig(model="dummy:tiny-llama", dtype="float32", device="cpu",
                          block_size=block_size, execution_mode="eager",
                          num_kv_blocks=args.batch * blocks, max_num_seqs=args.batch,
                          max_model_len=blocks * block_size)
    ctx = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                             backend="gloo")
    runner, _ = build_runner(config, ctx)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0)
    new = []
    for rid in range(args.batch):
        length = rng.randint(args.context_min, args.context_max)
        new.append(NewRequestData(rid, [rng.randrange(1000) for _ in range(length + 1)],
                                  list(range(rid * blocks, (rid + 1) * blocks)), length, 0, params))
    # Hand the requests over as if their prompts were computed (no forward pass needed).
    runner.apply_plan_state(StepPlan(0, new, [], [], []))
    bucket = StepShape(Phase.DECODE, args.batch, blocks * block_size)
    # One token for each of them: a plan that changes no state, so every call prepares alike.
    decode = StepPlan(1, [], list(range(args.batch)), [1] * args.batch, [[]] * args.batch,
                      bucket=bucket)
    for kernel in (TORCH, TRITON):
        runner.attention = kernel
        times = []
        for _ in range(args.calls):
            started = time.perf_counter()
            runner.prepare(decode)
            times.append((time.perf_counter() - started) * 1e3)
        name = "triton kernel (context lengths)" if kernel is TRITON else "torch attention (masks)"
        print(f"decode step of {args.batch} requests, contexts {args.context_min}-"
              f"{args.context_max}, {name}: median {statistics.median(times):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
