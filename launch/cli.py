"""`spmdrun [launcher options] {generate,serve,bench} [engine options]`: the command line.

Every engine option is generated from the fields of protocol.config.EngineConfig.
"""
from __future__ import annotations

import argparse
import math
import sys

import msgspec
from spmd_runtime.launch.bench import add_peer_options, add_throughput_workload_options
from spmd_runtime.protocol.config import EngineConfig, engine_config_choices, engine_config_fields
from spmd_runtime.protocol.model_config import MODEL_PRESETS
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.log_format import configure_logging

LAUNCHER_FIELDS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")


def add_engine_options(parser: argparse.ArgumentParser, *, only: tuple[str, ...] | None = None,
                       exclude: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field; unset flags stay absent so defaults live in one place."""
    choices = engine_config_choices()
    for name, kind, default, description in engine_config_fields():
        if (only is not None and name not in only) or name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{description} (default: {default})"
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS,
                                choices=choices.get(name),
                                metavar=None if name in choices else name.upper(), help=help_text)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    if getattr(args, "config_json", None):
        return EngineConfig.from_json(args.config_json)
    names = {name for name, *_ in engine_config_fields()}
    values = {k: v for k, v in vars(args).items() if k in names}
    try:
        return msgspec.convert(values, EngineConfig)
    except msgspec.ValidationError as error:
        raise SystemExit(f"spmdrun: invalid option: {error}") from None


def add_sampling_options(parser: argparse.ArgumentParser, *, max_tokens: int,
                         temperature: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=temperature,
                        help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as error:
        raise SystemExit(f"spmdrun: {error}") from None


def add_model_source_options(parser: argparse.ArgumentParser) -> None:
    """Bench spellings of --model: --load-format dummy and --model-config PRESET."""
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights (--dummy-seed) in the shape of --model or "
                        "--model-config, i.e. --model dummy:<that> (default: %(default)s)")
    parser.add_argument("--model-config", choices=tuple(MODEL_PRESETS),
                        help="a built-in model shape instead of --model; it has no weights, so "
                        "it implies --load-format dummy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spmdrun", description="Run an SPMD inference engine: a scheduler and one worker "
        "per device, on one node or many.")
    add_engine_options(parser, only=LAUNCHER_FIELDS)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts and print the answers")
    generate.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    generate.add_argument("--prompt-file", help="a file with one prompt per line")
    generate.add_argument("--no-chat-template", action="store_true",
                          help="send the raw text instead of applying the model's chat template")
    add_sampling_options(generate, max_tokens=128, temperature=0.0)
    add_engine_options(generate, exclude=LAUNCHER_FIELDS)

    serve = commands.add_parser("serve", help="serve RPC clients until stopped")
    add_engine_options(serve, exclude=LAUNCHER_FIELDS)
    serve.add_argument("--config-json", help=argparse.SUPPRESS)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    throughput = bench_kinds.add_parser(
        "throughput", help="offline throughput on random prompts (EOS ignored), optionally "
        "against Hugging Face transformers in the same run",
        epilog="issue 10's benchmark: spmdrun bench throughput --workload issue10 --load-format "
        "dummy --model-config llama-3.2-1b --with-peer")
    add_throughput_workload_options(throughput)
    throughput.add_argument("--with-peer", action="store_true",
                            help="after our run (its engine stopped), run the same prompts and "
                            "output lengths through transformers' continuous batching "
                            "(bench/hf_peer.py) on the same model, weights, dtype and device, "
                            "and print both rows and the ratio")
    add_peer_options(throughput)
    throughput.add_argument("--json", action="store_true", help="print one JSON line per row too")
    add_model_source_options(throughput)
    add_engine_options(throughput, exclude=LAUNCHER_FIELDS)

    prefix = bench_kinds.add_parser(
        "prefix", help="shared-prefix workload with prefix caching on and off, in the same run")
    prefix.add_argument("--num-prefixes", type=int, default=8)
    prefix.add_argument("--prefix-len", type=int, default=256,
                        help="shared tokens per prompt; 0 makes every prompt unique (0%% hits)")
    prefix.add_argument("--suffix-len", type=int, default=128)
    prefix.add_argument("--repeat", type=int, default=4, help="prompts per shared prefix")
    prefix.add_argument("--output-len", type=int, default=16)
    prefix.add_argument("--workload-seed", type=int, default=0)
    prefix.add_argument("--rounds", type=int, default=1,
                        help="on/off pairs to run, alternating their order (default: %(default)s)")
    add_model_source_options(prefix)
    add_engine_options(prefix, exclude=LAUNCHER_FIELDS + ("enable_prefix_caching",))

    pressure = bench_kinds.add_parser(
        "pressure", help="throughput with a roomy KV pool and with a small one (offload and "
        "soft reset), in the same run")
    pressure.add_argument("--num-requests", type=int, default=32)
    pressure.add_argument("--input-len-min", type=int, default=32)
    pressure.add_argument("--input-len-max", type=int, default=128)
    pressure.add_argument("--output-len", type=int, default=64)
    pressure.add_argument("--pressure-blocks", type=int, default=48,
                          help="KV blocks of the small pool (default: %(default)s)")
    pressure.add_argument("--swap-space-gib", type=float, default=1.0,
                          help="CPU swap space of the offload run (default: %(default)s)")
    pressure.add_argument("--workload-seed", type=int, default=0)
    pressure.add_argument("--rounds", type=int, default=1,
                          help="runs of each variant, rotating their order (default: %(default)s)")
    add_model_source_options(pressure)
    add_engine_options(pressure, exclude=LAUNCHER_FIELDS + ("swap_space",))

    serving = bench_kinds.add_parser(
        "serving", help="online load at a request rate against the HTTP front or the RPC "
        "endpoint: throughput, time to first token, time per output token, inter-token latency")
    serving.add_argument("--endpoint", choices=("http", "rpc"), default="http",
                         help="what to send requests to (default: %(default)s)")
    serving.add_argument("--url", default="",
                         help="a running server: http://host:port (HTTP front) or its RPC "
                         "address; empty starts an engine here with the engine options")
    serving.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    serving.add_argument("--num-requests", type=int, default=32)
    serving.add_argument("--input-len-min", type=int, default=32)
    serving.add_argument("--input-len-max", type=int, default=256)
    serving.add_argument("--num-prefixes", type=int, default=4,
                         help="shared-prefix: distinct prefixes (default: %(default)s)")
    serving.add_argument("--prefix-len", type=int, default=128)
    serving.add_argument("--suffix-len", type=int, default=32)
    serving.add_argument("--output-len", type=int, default=64)
    serving.add_argument("--request-rate", type=float, default=math.inf,
                         help="requests per second, Poisson arrivals; inf sends all at once "
                         "(default: %(default)s)")
    serving.add_argument("--max-concurrency", type=int, default=0,
                         help="most requests in flight; 0: no limit (default: %(default)s)")
    serving.add_argument("--workload-seed", type=int, default=0)
    serving.add_argument("--json", action="store_true", help="print one JSON line too")
    add_model_source_options(serving)
    add_engine_options(serving, exclude=LAUNCHER_FIELDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    configure_logging(config.log_level)
    from spmd_runtime.launch import commands
    if args.command == "generate":
        return commands.generate(config, args)
    if args.command == "serve":
        return commands.serve(config)
    return commands.bench(config, args)


if __name__ == "__main__":
    sys.exit(main())
