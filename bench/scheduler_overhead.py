"""Scheduler overhead per step with a fake worker that answers instantly.

256 running decode requests, prefix caching on. Times schedule + encode the plan + maintain +
decode the result + update, and reports the plan's bytes per decode request.

    python bench/scheduler_overhead.py --num-requests 256 --steps 200
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from spmd_runtime.protocol.messages import StepResult, scheduler_inbound_decoder
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.transport import Encoder
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.request import Request
from spmd_runtime.scheduler_proc.scheduler import Scheduler


def fake_result(step, rng: random.Random) -> StepResult:
    """What rank 0 would answer: a token for every request whose scheduled tokens reach its end."""
    ids = [rid for rid, n in step.num_scheduled.items()]
    return StepResult(step_id=step.plan.step_id, request_ids=ids,
                      sampled_token_ids=[rng.randrange(1000, 40000) for _ in ids],
                      forward_ms=0.0, prepare_ms=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    blocks_per_request = (args.prompt_len + args.steps + 64) // args.block_size + 1
    kv = KVCacheManager(args.num_requests * blocks_per_request, args.block_size, enable_caching=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=args.num_requests * args.prompt_len,
                          max_num_seqs=args.num_requests, max_model_len=8192, eos_token_ids=[2])
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


if __name__ == "__main__":
    sys.exit(main())
