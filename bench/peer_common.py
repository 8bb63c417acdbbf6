"""What every CPU peer of bench/cpu_peers.py shares: the run spec it reads, the result rows it
writes, and how throughput and latency are timed. Standard library only: the vLLM peer imports
it from vLLM's own venv.

A spec (JSON) is {"model": ..., "max_num_seqs": N, "max_model_len": N, "runs": [run, ...]}, a run
either {"mode": "throughput", "prompts": [[ids]...], "output_lens": [n...]} (all prompts at once,
each with its own output length) or {"mode": "latency", "prompts": [[ids]...], "output_len": N}
(one request at a time; the prompts are distinct so that no run hits a prefix cache). Greedy
decoding with EOS ignored throughout. A peer writes {"engine": ..., "startup_s": s,
"results": [row, ...]}, one row per run.
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence

# Generates greedy continuations (EOS ignored) of prompts, output_lens[i] tokens for prompt i,
# all submitted at once; returns the token ids of each.
Generate = Callable[[Sequence[Sequence[int]], Sequence[int]], list[list[int]]]

# A prompt no benchmark prompt starts with (as our engine's warm-up in launch.bench).
WARMUP_PROMPT = [3] * 8
# Timed calls of each kind in a latency run; the median is reported.
LATENCY_REPEATS = 3


def throughput_spec(prompts: list[list[int]], output_lens: list[int]) -> dict:
    return {"mode": "throughput", "prompts": prompts, "output_lens": output_lens}


def latency_spec(prompts: list[list[int]], output_len: int) -> dict:
    """2 * LATENCY_REPEATS distinct prompts: one per timed call."""
    if len(prompts) < 2 * LATENCY_REPEATS or output_len < 2:
        raise ValueError(f"a latency run needs {2 * LATENCY_REPEATS} prompts and an output "
                         "length of at least 2")
    return {"mode": "latency", "prompts": prompts, "output_len": output_len}


def longest_request(runs: list[dict]) -> int:
    """The most tokens (prompt + output) one request of the runs holds."""
    return max(len(p) + max(run.get("output_lens") or [run.get("output_len", 0)])
               for run in runs for p in run["prompts"])


def peer_spec(runs: list[dict], max_num_seqs: int, min_model_len: int = 2048) -> dict:
    """The spec of `runs` for engines running up to max_num_seqs requests at once."""
    return {"max_num_seqs": max_num_seqs, "runs": runs,
            "max_model_len": max(min_model_len, longest_request(runs))}


def throughput_row(engine: str, prompts: Sequence[Sequence[int]], outputs: list[list[int]],
                   elapsed_s: float) -> dict:
    """The fields of launch.bench.ThroughputReport, and the output token ids."""
    return {"mode": "throughput", "engine": engine, "num_requests": len(prompts),
            "input_tokens": sum(map(len, prompts)), "output_tokens": sum(map(len, outputs)),
            "elapsed_s": elapsed_s, "token_ids": outputs}


def time_throughput(engine: str, run: dict, generate: Generate) -> dict:
    """One generate call with every prompt, timed from call to return."""
    started = time.perf_counter()
    outputs = generate(run["prompts"], run["output_lens"])
    return throughput_row(engine, run["prompts"], outputs, time.perf_counter() - started)


def time_latency(engine: str, run: dict, generate: Generate) -> dict:
    """Single requests: TTFT is the median time of a 1-token generation, `full` the median time
    of an output_len generation, and ITL = (full - TTFT) / (output_len - 1)."""
    n = run["output_len"]

    def seconds(prompt: Sequence[int], max_tokens: int) -> float:
        started = time.perf_counter()
        generate([prompt], [max_tokens])
        return time.perf_counter() - started

    prompts = run["prompts"]
    ttft = statistics.median(seconds(p, 1) for p in prompts[0:2 * LATENCY_REPEATS:2])
    full = statistics.median(seconds(p, n) for p in prompts[1:2 * LATENCY_REPEATS:2])
    return latency_row(engine, len(prompts[0]), n, ttft, full)


def latency_row(engine: str, prompt_len: int, output_len: int, ttft_s: float, full_s: float) -> dict:
    return {"mode": "latency", "engine": engine, "prompt_len": prompt_len,
            "output_len": output_len, "ttft_s": ttft_s, "full_s": full_s,
            "itl_s": (full_s - ttft_s) / (output_len - 1)}


def run_spec(engine: str, runs: list[dict], generate: Generate) -> list[dict]:
    """A short warm-up, then every run in order: one result row each."""
    generate([WARMUP_PROMPT], [2])
    timers = {"throughput": time_throughput, "latency": time_latency}
    return [timers[run["mode"]](engine, run, generate) for run in runs]


def read_json(path: str) -> dict:
    with open(path) as file:
        return json.load(file)


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as file:
        json.dump(data, file)
