"""Structured-output overhead (issue 34): W1 with every request JSON-schema constrained against
W1 unconstrained, on one engine, rounds alternating, the median of the per-round ratios of
output tok/s.

    python bench/structured_overhead.py [--rounds 5] [--workload W1] [--dtype auto]

Both runs are greedy with EOS ignored. The constrained requests take a schema whose one string
cannot end before 4,096 characters ({"text": "..."}), so they run to their max_tokens as the
free ones do: tokens per second compare the same steps.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from spmd_runtime.launch.bench import THROUGHPUT_WORKLOADS
from spmd_runtime.runtime import LLM, SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}},
          "required": ["text"]}


def timed(llm, prompts, params) -> tuple[float, int]:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - started, sum(len(o.token_ids) for o in outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1", choices=sorted(THROUGHPUT_WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    workload = THROUGHPUT_WORKLOADS[args.workload]
    # Without prefix caching: every run computes its prompts (the same in every run).
    with LLM("smollm2", device="cpu", dtype=args.dtype, enable_prefix_caching=False) as llm:
        prompts = workload.prompts(llm.client.model_info().vocab_size)
        lens = workload.output_lens()
        runs = {"free": [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens],
                "json-schema": [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                               structured_output=StructuredOutput(json=SCHEMA))
                                for n in lens]}
        for params in runs.values():                    # compile the schema, warm both paths
            timed(llm, prompts[:8], params[:8])
        ratios = []
        for number in range(1, args.rounds + 1):
            order = list(runs) if number % 2 else list(runs)[::-1]
            rates = {}
            for name in order:
                seconds, tokens = timed(llm, prompts, runs[name])
                rates[name] = tokens / seconds
                print(f"round {number} {name:<12} {tokens:>6} out tokens {seconds:7.2f} s "
                      f"{rates[name]:8.1f} out tok/s", flush=True)
            ratios.append(rates["json-schema"] / rates["free"])
        print(f"{args.workload}: constrained / free output tok/s, median of {args.rounds} rounds: "
              f"{statistics.median(ratios):.3f}x (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
