"""A lone prompt's step with the one-call layer stack (spmd_cpu::prompt_layers) and without it,
in alternate steps of one process: the worker's model runner in process (no scheduler, no
sockets), fresh prompts of --tokens random tokens, the median of each side's step times.

    python bench/prompt_stack_ab.py --tokens 512 --steps 40
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import spmd_runtime.runtime.models.llama as llama
import torch
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.worker import build_runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40, help="steps in all, alternating")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", num_kv_blocks=2048,
                          quantization=args.quantization)
    context = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                                 backend="gloo")
    runner, _ = build_runner(config, context)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    stack, times = llama.prompt_stack, {True: [], False: []}
    blocks = list(range(1, 1 + -(-(args.tokens + 64) // config.block_size)))
    finished: list[int] = []
    for step in range(args.steps + 4):
        on = step % 2 == 0
        llama.prompt_stack = stack if on else (lambda *_: None)
        prompt = torch.randint(0, 49152, (args.tokens,), generator=generator).tolist()
        plan = StepPlan(step + 1, [NewRequestData(step, prompt, blocks, 0, args.tokens, params)],
                        [], [], [], finished)
        started = time.perf_counter()
        runner.execute(plan)
        if step >= 4:                   # the first steps warm the allocator and caches
            times[on].append((time.perf_counter() - started) * 1e3)
        finished = [step]
    llama.prompt_stack = stack
    for on in (True, False):
        print(f"{'stack' if on else 'loop '}: median {statistics.median(times[on]):.2f} ms, "
              f"min {min(times[on]):.2f} ms over {len(times[on])} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
