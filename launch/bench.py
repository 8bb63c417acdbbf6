"""Benchmark workloads and reports shared by `spmdrun bench` and the peer scripts in bench/."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def random_workload(num_requests: int, input_len_min: int, input_len_max: int,
                    vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of random token ids with lengths uniform in [input_len_min, input_len_max]."""
    rng = random.Random(seed)
    # Stay clear of the lowest ids, where tokenizers keep their special tokens.
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randint(input_len_min, input_len_max))]
            for _ in range(num_requests)]


def shared_prefix_workload(num_prefixes: int, prefix_len: int, suffix_len: int, repeat: int,
                           vocab_size: int, seed: int) -> list[list[int]]:
    """`repeat` prompts per shared prefix, each with its own suffix.

    Rounds are interleaved (every prefix once, then every prefix again...) so that a prefix's
    first prompt has been computed, and its blocks cached, before the next one arrives.
    """
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    prefixes = [tokens(prefix_len) for _ in range(num_prefixes)]
    return [prefix + tokens(suffix_len) for _ in range(repeat) for prefix in prefixes]


@dataclass(frozen=True)
class ThroughputWorkload:
    """Random prompts with lengths uniform in [input_len_min, input_len_max] and, for each, an
    output length uniform in [output_len_min, output_len_max] (generated with EOS ignored)."""

    num_requests: int
    input_len_min: int
    input_len_max: int
    output_len_min: int
    output_len_max: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not 1 <= self.input_len_min <= self.input_len_max \
                or not 1 <= self.output_len_min <= self.output_len_max:
            raise ValueError("need at least one request and 1 <= min <= max for the input and "
                             f"output lengths, got {self}")

    def prompts(self, vocab_size: int) -> list[list[int]]:
        return random_workload(self.num_requests, self.input_len_min, self.input_len_max,
                               vocab_size, self.seed)

    def output_lens(self) -> list[int]:
        """One output length per prompt; a generator of their own, so the prompts (which depend
        on the vocabulary size) do not shift them."""
        rng = random.Random(f"output lengths {self.seed}")
        return [rng.randint(self.output_len_min, self.output_len_max) for _ in range(self.num_requests)]

    def describe(self) -> str:
        outputs = (f"{self.output_len_min}" if self.output_len_min == self.output_len_max
                   else f"[{self.output_len_min}, {self.output_len_max}]")
        return (f"{self.num_requests} requests, prompt lengths [{self.input_len_min}, "
                f"{self.input_len_max}], output lengths {outputs}")


THROUGHPUT_WORKLOADS = {
    "default": ThroughputWorkload(32, 32, 256, 64, 64),
    # Issue 10's comparison with transformers (with --load-format dummy --model-config llama-3.2-1b).
    "issue10": ThroughputWorkload(256, 100, 1024, 100, 1024),
    # Issue 18's CPU comparisons with vLLM and llama.cpp (bench/cpu_peers.py). B1 is one
    # request: cpu_peers.py times its TTFT and ITL rather than its throughput.
    "W1": ThroughputWorkload(32, 32, 256, 64, 64),
    "W2": ThroughputWorkload(64, 16, 64, 128, 128),
    "B1": ThroughputWorkload(1, 512, 512, 128, 128),
    # Issue 30's prefill-heavy comparison: long prompts, few outputs.
    "W4": ThroughputWorkload(32, 256, 768, 16, 16),
}


def add_throughput_workload_options(parser: argparse.ArgumentParser) -> None:
    """--workload and the options that override its values, for ThroughputWorkload."""
    presets = "; ".join(f"{name}: {w.describe()}" for name, w in THROUGHPUT_WORKLOADS.items())
    parser.add_argument("--workload", choices=tuple(THROUGHPUT_WORKLOADS), default="default",
                        help=f"the defaults of the workload options below ({presets}); options "
                        "given override them (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, metavar="N")
    parser.add_argument("--input-len-min", type=int, metavar="N", help="prompt lengths are "
                        "drawn uniformly from [--input-len-min, --input-len-max]")
    parser.add_argument("--input-len-max", type=int, metavar="N")
    parser.add_argument("--output-len", type=int, metavar="N",
                        help="one output length for every request (EOS is ignored)")
    parser.add_argument("--output-len-min", type=int, metavar="N", help="or each request's own, "
                        "drawn uniformly from [--output-len-min, --output-len-max]")
    parser.add_argument("--output-len-max", type=int, metavar="N")
    parser.add_argument("--seed", "--workload-seed", dest="workload_seed", type=int, metavar="SEED",
                        help="seed of the prompts and output lengths (default: 0; the dummy "
                        "weights' seed is --dummy-seed)")


def add_peer_options(parser: argparse.ArgumentParser) -> None:
    """Options of the transformers peer run (launch/hf_peer.py)."""
    parser.add_argument("--peer-cache", choices=("auto", "same"), default="auto",
                        help="auto: transformers sizes its batch and KV cache from free memory, as "
                        "generate_batch does; same: our --max-num-batched-tokens as its step "
                        "budget and, with --num-kv-blocks, our KV capacity (default: %(default)s)")
    parser.add_argument("--peer-api", choices=("manager", "generate_batch"), default="manager",
                        help="manager: requests through generate_batch's manager, timed from the "
                        "first request to the last result, like ours; generate_batch: one "
                        "generate_batch call timed whole, its set-up included (fixed output "
                        "length only) (default: %(default)s)")
    parser.add_argument("--peer-threads", type=int, metavar="N", default=None,
                        help="torch threads of the transformers run (default: torch's)")


def throughput_workload_from_args(args: argparse.Namespace) -> ThroughputWorkload:
    """The --workload preset with the options given on top; ValueError for conflicts."""
    fixed = args.output_len
    if fixed is not None and (args.output_len_min is not None or args.output_len_max is not None):
        raise ValueError("give --output-len, or --output-len-min and --output-len-max, not both")
    given = {"num_requests": args.num_requests, "input_len_min": args.input_len_min,
             "input_len_max": args.input_len_max, "seed": args.workload_seed,
             "output_len_min": args.output_len_min if fixed is None else fixed,
             "output_len_max": args.output_len_max if fixed is None else fixed}
    return dataclasses.replace(THROUGHPUT_WORKLOADS[args.workload],
                               **{k: v for k, v in given.items() if v is not None})


@dataclass
class ThroughputReport:
    engine: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_tokens / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def row(self) -> str:
        return (f"{self.engine:<24} {self.num_requests:>8} {self.input_tokens:>9} "
                f"{self.output_tokens:>9} {self.elapsed_s:>9.2f} {self.requests_per_s:>8.2f} "
                f"{self.input_tokens_per_s:>10.1f} {self.output_tokens_per_s:>10.1f}")

    def to_json(self) -> str:
        data = asdict(self)
        data.update(requests_per_s=self.requests_per_s, input_tokens_per_s=self.input_tokens_per_s,
                    output_tokens_per_s=self.output_tokens_per_s)
        return json.dumps(data)


TABLE_HEADER = (f"{'engine':<24} {'requests':>8} {'in tok':>9} {'out tok':>9} {'seconds':>9} "
                f"{'req/s':>8} {'in tok/s':>10} {'out tok/s':>10}")


def run_throughput(client, prompts: list[list[int]], output_lens: int | Sequence[int], engine: str,
                   alive=None, auth_token: str = "") -> ThroughputReport:
    """Time one offline batch through an engine client (greedy, EOS ignored, the output length
    of each prompt, or one for all). alive() tells whether the engine's processes still run (a
    dead engine fails at once); auth_token is the server's --auth-token, if it has one."""
    from spmd_runtime.protocol.sampling import SamplingParams
    lens = [output_lens] * len(prompts) if isinstance(output_lens, int) else list(output_lens)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
    # Warm-up on tokens no benchmark prompt starts with, so it seeds no prefix cache hit.
    client.generate([[3] * 8], SamplingParams(max_tokens=2, temperature=0.0))
    started = time.perf_counter()
    outputs = _generate_each(client.address, prompts, params, engine, alive, auth_token)
    elapsed = time.perf_counter() - started
    return ThroughputReport(engine, len(prompts), sum(map(len, prompts)),
                            sum(len(o.token_ids) for o in outputs), elapsed)


def _generate_each(address: str, prompts: list[list[int]], params: list, description: str,
                   alive, auth_token: str) -> list:
    """launch.progress.generate_with_progress with sampling parameters per prompt."""
    from spmd_runtime.launch.progress import Progress
    from spmd_runtime.runtime.async_client import AsyncClient

    async def run() -> list:
        async with AsyncClient(address, alive=alive, auth_token=auth_token) as client:
            with Progress(len(prompts), description) as progress:
                return await client.generate(prompts, params, on_finished=lambda _: progress.update())

    return asyncio.run(run())
