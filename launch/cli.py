"""`spmdrun [launcher options] {generate,serve,bench} [options]`: the command line.

Every engine option is generated from the fields of protocol.config.EngineConfig and shown in
the --help section of the domain declaring it (protocol/config_fields.py); each subcommand takes
the options it uses (the removed spellings of those are parsed only to be refused with the
option that replaced them, protocol/deprecated_options.py).
"""
from __future__ import annotations

import argparse
import difflib
import math
import sys
import traceback

from spmd_runtime.launch.bench import add_peer_options, add_throughput_workload_options
from spmd_runtime.launch.command_options import bench_model, command_options
from spmd_runtime.launch.help_format import ADVANCED_FIELDS, CommandLineParser, HelpAll
from spmd_runtime.launch.options import (
    config_from_args,
    prompts_from_args,
    sampling_from_args,
    token_warnings,
)
from spmd_runtime.protocol.config import (
    OPTION_GROUPS,
    EngineConfig,
    engine_config_choices,
    engine_config_fields,
)
from spmd_runtime.protocol.curve import CurveKeyError, make_job_keys
from spmd_runtime.protocol.deprecated_options import REMOVED_OPTIONS
from spmd_runtime.protocol.model_config import MODEL_PRESETS
from spmd_runtime.runtime.log_format import configure_logging
from spmd_runtime.runtime.preflight import ConfigError, check_config, security_warnings

__all__ = ["LAUNCHER_FIELDS", "build_parser", "config_from_args", "main"]

LAUNCHER_FIELDS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")
# The spellings a vLLM user would try, beside each field's own flag.
ALIASES = {"http_host": ("--host",), "http_port": ("--port",), "auth_token": ("--api-key",)}
# What only a server uses: the other commands talk to their engine over a private socket.
SERVER_FIELDS = ("served_model_name", "rpc_address", "http_host", "http_port",
                 "max_message_bytes", "enable_admin", "admin_token", "tool_call_parser")
OPTIONS_USAGE = "%(prog)s [options]"
FIELDS = {name: (kind, default, description)
          for name, kind, default, description in engine_config_fields()}


def add_engine_options(parser: argparse.ArgumentParser, fields) -> None:
    """One flag per EngineConfig field in `fields`, in its --help section (advanced ones only
    in --help-all); flags not given stay absent from the namespace, so that the defaults live
    in EngineConfig alone."""
    choices = engine_config_choices()
    parser.add_argument("--help-all", action=HelpAll,
                        help="show this help with every option, the advanced ones too")
    for title, names in OPTION_GROUPS.items():
        names = [name for name in names if name in fields]
        if not names:
            continue
        hidden = sum(name in ADVANCED_FIELDS for name in names)
        group = parser.add_argument_group(title, f"{hidden} more: --help-all" if hidden else None)
        for name in names:
            kind, default, description = FIELDS[name]
            flags = ["--" + name.replace("_", "-"), *ALIASES.get(name, ())]
            help_text = f"{description} (default: {default!r})".replace("%", "%%")
            if kind is bool:
                action = group.add_argument(*flags, dest=name, default=argparse.SUPPRESS,
                                            action=argparse.BooleanOptionalAction,
                                            help=help_text)
            else:
                action = group.add_argument(*flags, dest=name, type=kind,
                                            default=argparse.SUPPRESS, choices=choices.get(name),
                                            metavar=None if name in choices else name.upper(),
                                            help=help_text)
            if name in ADVANCED_FIELDS:
                action.advanced_help, action.help = action.help, argparse.SUPPRESS
            if name == "nproc_per_node":
                group.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                                   default=argparse.SUPPRESS,
                                   help="tensor-parallel size over all nodes: sets "
                                   "--nproc-per-node to N / --nnodes")
    if "execution_mode" in fields:
        _add_removed_options(parser)


def _add_removed_options(parser: argparse.ArgumentParser) -> None:
    """The removed spellings, out of --help, parsed only so that giving one is refused with
    the option that replaced it (launch/options.py)."""
    for option in REMOVED_OPTIONS.values():
        if option.kind is bool:
            parser.add_argument(option.flag, dest=option.name,
                                action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            parser.add_argument(option.flag, dest=option.name, nargs="?",
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def engine_fields(*, exclude: tuple[str, ...] = ()) -> list[str]:
    return [name for name in FIELDS if name not in exclude]


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128,
                       help="most tokens to generate per prompt (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="nucleus sampling: smallest set of tokens with this much probability; "
                       "1 keeps all (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=-1,
                       help="sample among the k likeliest tokens; -1 keeps all (default: "
                       "%(default)s)")
    group.add_argument("--seed", type=int, default=None,
                       help="per-request sampling seed (default: none, a random one)")


def add_model_source_options(parser: argparse.ArgumentParser) -> None:
    """Bench spellings of --model: --load-format dummy and --model-config PRESET."""
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights (--dummy-seed) in the shape of --model or "
                        "--model-config, i.e. --model dummy:<that> (default: %(default)s)")
    parser.add_argument("--model-config", choices=tuple(MODEL_PRESETS),
                        help="a built-in model shape instead of --model; it has no weights, so "
                        "it implies --load-format dummy (default: none)")


def build_parser() -> CommandLineParser:
    parser = CommandLineParser(
        prog="spmdrun", usage="%(prog)s [launcher options] COMMAND [options]",
        description="Run an SPMD inference engine: a scheduler and one worker "
        "per device, on one node or many. The launcher options are accepted before the "
        "command too.")
    group = parser.add_argument_group("launcher")
    for name in LAUNCHER_FIELDS:
        kind, default, description = FIELDS[name]
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, metavar=name.upper(),
                           default=argparse.SUPPRESS, help=f"{description} (default: {default!r})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", prog="spmdrun",
                                     title="commands")
    _add_generate(commands)
    keys = commands.add_parser(
        "keys", usage="%(prog)s DIR", help="make a job's CURVE key pair for encrypted sockets",
        description="Write a fresh CURVE key pair for one job: DIR/job.key (public: give it to "
        "every node and client) and DIR/job.key_secret (secret, readable by you only: node 0 "
        "needs it). Then start every node with --curve-keys DIR (other nodes may get "
        "DIR/job.key alone) and give clients server_key='DIR/job.key'.")
    keys.add_argument("directory", metavar="DIR", help="where to write the keys (made if missing)")
    # Listed for --help; main() hands its arguments to runtime/layers/cpu_kernel_build.py.
    commands.add_parser("build-kernels", add_help=False,
                        help="build the C++ CPU operators ahead of serving (make env runs it)")
    serve = commands.add_parser(
        "serve", usage=OPTIONS_USAGE, help="serve RPC clients (and HTTP with --port) until stopped",
        description="Serve RPC clients, and OpenAI-compatible HTTP with --port, until Ctrl-C or "
        "SIGTERM.")
    add_engine_options(serve, engine_fields())
    serve.add_argument("--config-json", help=argparse.SUPPRESS)
    bench = commands.add_parser("bench", usage="%(prog)s KIND [options]", help="benchmarks",
                                description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND",
                                 prog="spmdrun bench",
                                 title="benchmarks")
    _add_bench_throughput(kinds)
    _add_bench_prefix(kinds)
    _add_bench_pressure(kinds)
    _add_bench_serving(kinds)
    return parser


def _add_generate(commands) -> None:
    generate = commands.add_parser(
        "generate", usage="%(prog)s [options] [PROMPT ...]",
        help="complete prompts and print the answers", description="Complete "
        "prompts and print each answer as it completes (answers on stdout, logs on stderr).",
        epilog='example: spmdrun generate "What is 2+2?" --max-tokens 32')
    generate.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to complete")
    generate.add_argument("--prompt", action="append", default=[],
                          help="a prompt (repeatable; default: none)")
    generate.add_argument("--prompt-file", help="a file with one prompt per line (default: none)")
    generate.add_argument("--no-chat-template", action="store_true",
                          help="send the raw text instead of applying the model's chat template")
    generate.add_argument("--output", choices=("text", "jsonl"), default="text",
                          help="text: each answer (labelled [index] when there are several); "
                          "jsonl: one JSON object per answer with index, prompt, text, "
                          "token_ids and finish_reason (default: %(default)s)")
    add_sampling_options(generate)
    add_engine_options(generate, engine_fields(exclude=SERVER_FIELDS))


def _add_bench_throughput(kinds) -> None:
    throughput = kinds.add_parser(
        "throughput", usage=OPTIONS_USAGE, help="offline throughput on random prompts (EOS "
        "ignored), optionally "
        "against Hugging Face transformers in the same run",
        epilog="issue 10's benchmark: spmdrun bench throughput --workload issue10 --load-format "
        "dummy --model-config llama-3.2-1b --with-peer")
    add_throughput_workload_options(throughput)
    throughput.add_argument("--with-peer", action="store_true",
                            help="after our run (its engine stopped), run the same prompts and "
                            "output lengths through transformers' continuous batching "
                            "(launch/hf_peer.py) on the same model, weights, dtype and device, "
                            "and print both rows and the ratio")
    add_peer_options(throughput)
    throughput.add_argument("--json", action="store_true", help="print one JSON line per row too")
    add_model_source_options(throughput)
    add_engine_options(throughput, engine_fields(exclude=SERVER_FIELDS))


def _add_bench_prefix(kinds) -> None:
    prefix = kinds.add_parser(
        "prefix", usage=OPTIONS_USAGE,
        help="shared-prefix workload with prefix caching on and off, in the same run")
    prefix.add_argument("--num-prefixes", type=int, default=8)
    prefix.add_argument("--prefix-len", type=int, default=256,
                        help="shared tokens per prompt; 0 makes every prompt unique (0%% hits)")
    prefix.add_argument("--suffix-len", type=int, default=128)
    prefix.add_argument("--repeat", type=int, default=4, help="prompts per shared prefix")
    prefix.add_argument("--output-len", type=int, default=16)
    prefix.add_argument("--workload-seed", type=int, default=0)
    prefix.add_argument("--rounds", type=int, default=1,
                        help="on/off pairs to run, alternating their order")
    add_model_source_options(prefix)
    add_engine_options(prefix, engine_fields(exclude=SERVER_FIELDS + ("enable_prefix_caching",)))


def _add_bench_pressure(kinds) -> None:
    pressure = kinds.add_parser(
        "pressure", usage=OPTIONS_USAGE, help="throughput with a roomy KV pool and with a "
        "small one (offload and "
        "soft reset), in the same run")
    pressure.add_argument("--num-requests", type=int, default=32)
    pressure.add_argument("--input-len-min", type=int, default=32)
    pressure.add_argument("--input-len-max", type=int, default=128)
    pressure.add_argument("--output-len", type=int, default=64)
    pressure.add_argument("--pressure-blocks", type=int, default=48,
                          help="KV blocks of the small pool")
    pressure.add_argument("--swap-space-gib", type=float, default=1.0,
                          help="CPU swap space of the offload run (its --kv-swap-memory), GiB")
    pressure.add_argument("--workload-seed", type=int, default=0)
    pressure.add_argument("--rounds", type=int, default=1,
                          help="runs of each variant, rotating their order")
    add_model_source_options(pressure)
    add_engine_options(pressure, engine_fields(exclude=SERVER_FIELDS + ("kv_swap_memory",)))


def _add_bench_serving(kinds) -> None:
    serving = kinds.add_parser(
        "serving", usage=OPTIONS_USAGE, help="online load at a request rate against the HTTP "
        "front or the RPC "
        "endpoint: throughput, time to first token, time per output token, inter-token latency")
    serving.add_argument("--endpoint", choices=("http", "rpc"), default="http",
                         help="what to send requests to")
    serving.add_argument("--url", default="",
                         help="a running server: http://host:port (HTTP front) or its RPC "
                         "address; empty starts an engine here with the engine options")
    serving.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    serving.add_argument("--num-requests", type=int, default=32)
    serving.add_argument("--input-len-min", type=int, default=32)
    serving.add_argument("--input-len-max", type=int, default=256)
    serving.add_argument("--num-prefixes", type=int, default=4,
                         help="shared-prefix: distinct prefixes")
    serving.add_argument("--prefix-len", type=int, default=128)
    serving.add_argument("--suffix-len", type=int, default=32)
    serving.add_argument("--output-len", type=int, default=64)
    serving.add_argument("--request-rate", type=float, default=math.inf,
                         help="requests per second, Poisson arrivals; inf sends all at once")
    serving.add_argument("--max-concurrency", type=int, default=0,
                         help="most requests in flight; 0: no limit")
    serving.add_argument("--workload-seed", type=int, default=0)
    serving.add_argument("--json", action="store_true", help="print one JSON line too")
    add_model_source_options(serving)
    add_engine_options(serving, engine_fields(
        exclude=("rpc_address", "enable_admin", "admin_token")))


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers under `parser`, by name ("bench serving" for nested ones)."""
    found = {}
    for action in parser._actions:            # argparse lists its subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in subcommand_parsers(sub).items()})
    return found


def _unrecognized(extras: list[str], command: str, parsers: dict) -> str:
    """The one-line error for arguments no option took: the commands that have that option,
    or the nearest option of this one."""
    option = next((arg.split("=", 1)[0] for arg in extras if arg.startswith("-")), None)
    if option is None:
        return f"unexpected argument {extras[0]!r} for `spmdrun {command}`"
    elsewhere = [f"`spmdrun {name}`" for name, sub in parsers.items()
                 if name != command and option in sub._option_string_actions]
    if elsewhere:
        return f"`spmdrun {command}` has no option {option} (it is one of {', '.join(elsewhere)})"
    # argparse lists a parser's options nowhere public; compared without their dashes.
    valid = {name.lstrip("-"): name for name in parsers[command]._option_string_actions}
    nearest = difflib.get_close_matches(option.lstrip("-"), valid, n=1, cutoff=0.6)
    if nearest:
        return f"unrecognized option {option}: did you mean {valid[nearest[0]]}?"
    return f"unrecognized option {option}"


def parse_command_line(parser: CommandLineParser, argv: list[str] | None) -> argparse.Namespace:
    args, extras = parser.parse_known_args(argv)
    if args.command == "generate":
        # argparse takes one run of positionals: prompts after an option come back unparsed.
        args.prompts += [arg for arg in extras if not arg.startswith("-")]
        extras = [arg for arg in extras if arg.startswith("-")]
    if extras:
        command = " ".join(filter(None, (args.command, getattr(args, "bench_kind", None))))
        parsers = subcommand_parsers(parser)
        parsers[command].error(_unrecognized(extras, command, parsers))
    return args


def prepare(args: argparse.Namespace) -> EngineConfig:
    """Everything that can go wrong before a process starts, checked: ConfigError if not."""
    config = config_from_args(args)
    configure_logging(config.log_level)
    if args.command == "bench":
        config = bench_model(config, args.model_config, args.load_format, "model" in args)
    if args.command == "generate":
        args.prompts = prompts_from_args(args, config.model)
        args.sampling = sampling_from_args(args)
    if not getattr(args, "url", ""):              # bench serving --url starts no engine
        check_config(config, serves_rpc=args.command == "serve")
    for warning in token_warnings(args) + security_warnings(config):
        print(f"spmdrun: warning: {warning}", file=sys.stderr, flush=True)
    if args.command in ("generate", "serve") and config.log_level in ("debug", "info"):
        print(f"spmdrun: loading model {config.model} …", file=sys.stderr, flush=True)
    return config


def make_keys(directory: str) -> int:
    try:
        public, secret = make_job_keys(directory)
    except (CurveKeyError, OSError) as error:
        raise ConfigError(str(error)) from None
    print(f"spmdrun: wrote {public} (public: every node and client) and {secret} (secret: "
          f"node 0 only); start each node with --curve-keys {directory}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build-kernels"]:
        from spmd_runtime.runtime.layers.cpu_kernel_build import main as build_kernels
        return build_kernels(argv[1:])
    args = parse_command_line(build_parser(), argv)
    try:
        if args.command == "keys":
            return make_keys(args.directory)
        config = prepare(args)
        options = command_options(args)
        from spmd_runtime.launch.commands import run_command  # loads the client side
        return run_command(config, options)
    except ConfigError as error:
        if getattr(args, "log_level", "") == "debug":
            traceback.print_exc()
        print(f"spmdrun: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
