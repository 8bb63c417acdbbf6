"""Output throughput against concurrency on CPU (issue 18): spmd-runtime's configs and vLLM's CPU
backend (and llama.cpp's server with --peers vllm,llamacpp), plotted to docs/scaling_cpu.png.

    python bench/scaling_plot.py
    python bench/scaling_plot.py --concurrency 1,4 --out /tmp/scaling.png --ours fp32={} \
        --ours int8='{"quantization": "int8"}'

For each concurrency c, c requests of fixed-length random prompts (--prompt-len, 128 tokens by
default) each generating --output-len tokens (64; greedy, EOS ignored) are submitted at once and
timed as one batch, as bench/cpu_peers.py times a workload. Each engine starts once (not timed)
with max_num_seqs = the largest c, and runs the whole sweep in that start. Writes the figure,
a JSON of the figures beside it (same name, .json) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from cpu_peers import MODEL, add_engine_options, engines_from_args, peer_dtype, throughput_report
from peer_common import peer_spec, throughput_spec
from spmd_runtime.launch.bench import ThroughputWorkload

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "scaling_cpu.png"


def sweep_runs(concurrency: list[int], prompt_len: int, output_len: int, vocab_size: int,
               seed: int) -> list[dict]:
    """One throughput run per concurrency, each with prompts of its own."""
    return [throughput_spec(ThroughputWorkload(c, prompt_len, prompt_len, output_len, output_len,
                                               seed + i).prompts(vocab_size), [output_len] * c)
            for i, c in enumerate(concurrency)]


def print_table(figures: dict[str, dict[int, float]], concurrency: list[int]) -> None:
    names = list(figures)
    print("output tok/s by concurrency")
    print(f"{'concurrency':>11} " + " ".join(f"{n:>24}" for n in names))
    for c in concurrency:
        print(f"{c:>11} " + " ".join(f"{figures[n][c]:>24.1f}" for n in names))


def plot(figures: dict[str, dict[int, float]], title: str, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_c in figures.items():
        ax.plot(list(by_c), list(by_c.values()), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(next(iter(figures.values()))))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_options(parser, peers="vllm")
    parser.add_argument("--concurrency", default="1,4,16,64,128",
                        help="comma-separated request counts (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the figure; its figures go to the same name with .json "
                        "(default: %(default)s)")
    args = parser.parse_args()
    try:
        concurrency = sorted({int(c) for c in args.concurrency.split(",")})
        engines = engines_from_args(args, agreement_prompts=0)
    except ValueError as error:
        parser.error(str(error))
    from spmd_runtime.runtime.loaders import load_model_config, resolve_model
    runs = sweep_runs(concurrency, args.prompt_len, args.output_len,
                      load_model_config(resolve_model(MODEL)).vocab_size, args.seed)
    spec = {**peer_spec(runs, max_num_seqs=max(concurrency)), "dtype": peer_dtype(args)}
    figures = {}
    for engine in engines:
        print(f"{engine.name}: concurrency {concurrency}", flush=True)
        result = engine.run(spec)
        figures[engine.name] = {len(run["prompts"]): throughput_report(row).output_tokens_per_s
                                for run, row in zip(runs, result["results"], strict=True)}
    print_table(figures, concurrency)
    title = (f"{MODEL} {peer_dtype(args)}, {args.prompt_len}-token prompts, {args.output_len} out each; "
             f"{cpu_name()}, {os.cpu_count()} cores")
    # The figures first: a missing matplotlib (not in the engine's requirements) keeps them.
    args.out.with_suffix(".json").write_text(json.dumps({
        "prompt_len": args.prompt_len, "output_len": args.output_len, "cpu": cpu_name(),
        "out_tokens_per_s": figures}, indent=1))
    plot(figures, title, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
