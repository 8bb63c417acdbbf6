"""Benchmark workloads and reports shared by `spmdrun bench` and the peer scripts in bench/."""
from __future__ import annotations

import json
import random
import time
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


def run_throughput(client, prompts: list[list[int]], output_len: int, engine: str,
                   alive=None, auth_token: str = "") -> ThroughputReport:
    """Time one offline batch through an engine client (greedy, EOS ignored, fixed output length).
    alive() tells whether the engine's processes still run (a dead engine fails at once);
    auth_token is the server's --auth-token, if it has one."""
    from launch.progress import generate_with_progress
    from protocol.sampling import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up on tokens no benchmark prompt starts with, so it seeds no prefix cache hit.
    client.generate([[3] * 8], SamplingParams(max_tokens=2, temperature=0.0))
    started = time.perf_counter()
    outputs = generate_with_progress(client.address, prompts, params, engine, alive, auth_token)
    elapsed = time.perf_counter() - started
    return ThroughputReport(engine, len(prompts), sum(map(len, prompts)),
                            sum(len(o.token_ids) for o in outputs), elapsed)
