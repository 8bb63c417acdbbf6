"""Where one worker step spends its time: a decode step and a prefill step, with torch's profiler.

Builds the model runner in process (no scheduler, no sockets) on the embedded model and feeds it
hand-made step plans, so the figures are the worker's alone.

    python bench/step_profile.py --batch 32 --context 176 --prefill-tokens 1024
    python bench/step_profile.py --model FILE.gguf --quantization gguf --batch 1 --context 16 \
        --prefill-tokens 16 --num-kv-blocks 64 --trace
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.worker import build_runner


def request_blocks(length: int, block_size: int) -> int:
    """A request's blocks: its prompt and room for 64 generated tokens."""
    return -(-(length + 64) // block_size)


def blocks_needed(args: argparse.Namespace, block_size: int) -> int:
    """Blocks the steps hand out (from block 1): the decode batch, three prefills, and with
    --trace a second batch and a fourth prefill."""
    batches, prefills = (2, 4) if args.trace else (1, 3)
    return 1 + batches * args.batch * request_blocks(args.context, block_size) + \
        prefills * request_blocks(args.prefill_tokens, block_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=176)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trace", action="store_true", help="print the profiler's op table")
    parser.add_argument("--model", default="smollm2", help="what --model serves (default smollm2)")
    parser.add_argument("--num-kv-blocks", type=int, default=0,
                        help="KV blocks of the runner (default 0: as many as the steps take)")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "gguf"))
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "cpp"))
    parser.add_argument("--dtype", default="float32", help="the engine's --dtype (default float32)")
    args = parser.parse_args()
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    bs = EngineConfig().block_size
    needed = blocks_needed(args, bs)
    if args.num_kv_blocks and args.num_kv_blocks < needed:
        parser.error(f"--num-kv-blocks {args.num_kv_blocks} is too few: --batch {args.batch} "
                     f"--context {args.context} --prefill-tokens {args.prefill_tokens}"
                     f"{' --trace' if args.trace else ''} take {needed}; give at least that, "
                     "or 0 for exactly that")
    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu",
                          num_kv_blocks=args.num_kv_blocks or needed,
                          quantization=args.quantization, attention_backend=args.attention_backend)
    ctx = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                             backend="gloo")
    runner, ready = build_runner(config, ctx)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, ready.vocab_size, (n,), generator=generator).tolist()

    next_block = 1
    step_id = 0

    def new_request(request_id: int, length: int, scheduled: int) -> NewRequestData:
        nonlocal next_block
        blocks = list(range(next_block, next_block + request_blocks(length, bs)))
        next_block += len(blocks)
        return NewRequestData(request_id, prompt(length), blocks, 0, scheduled, params)

    def run(plan: StepPlan) -> float:
        started = time.perf_counter()
        runner.execute(plan)
        return (time.perf_counter() - started) * 1e3

    # Prefill the decode batch's context, then time decode steps.
    reqs = [new_request(i, args.context, args.context) for i in range(args.batch)]
    for first in range(0, len(reqs), 8):
        step_id += 1
        run(StepPlan(step_id, reqs[first:first + 8], [], [], []))
    ids = [r.request_id for r in reqs]

    def decode_plan() -> StepPlan:
        nonlocal step_id
        step_id += 1
        return StepPlan(step_id, [], ids, [1] * len(ids), [[] for _ in ids])

    run(decode_plan())
    decode = [run(decode_plan()) for _ in range(args.steps)]
    prefills = []
    for k in range(3):
        step_id += 1
        length = args.prefill_tokens
        prefills.append(run(StepPlan(step_id, [new_request(1000 + k, length, length)], [], [], [],
                                     ids)))
        ids = []
    print(f"decode step, batch {args.batch}, context ~{args.context}: "
          f"median {sorted(decode)[len(decode) // 2]:.1f} ms ({decode})")
    print(f"prefill step, {args.prefill_tokens} tokens: median {sorted(prefills)[1]:.1f} ms")
    if args.trace:
        ids = [r.request_id for r in reqs]
        reqs2 = [new_request(2000 + i, args.context, args.context) for i in range(args.batch)]
        for first in range(0, len(reqs2), 8):
            step_id += 1
            run(StepPlan(step_id, reqs2[first:first + 8], [], [], []))
        ids = [r.request_id for r in reqs2]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                run(decode_plan())
        print("decode steps (3):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        step_id += 1
        fresh = new_request(3000, args.prefill_tokens, args.prefill_tokens)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(StepPlan(step_id, [fresh], [], [], [], ids))
        print(f"prefill step ({args.prefill_tokens} tokens):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
