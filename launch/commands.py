"""The subcommands: generate, serve, bench."""
from __future__ import annotations

import argparse
import sys

import msgspec

from launch.bench import TABLE_HEADER, random_workload, run_throughput, shared_prefix_workload
from launch.cli import sampling_from_args
from launch.running import RunningEngine, exit_with_failure
from launch.supervisor import ChildExited
from protocol.config import EngineConfig
from runtime.chat import chat_prompt_ids
from runtime.client import EngineError


def _supervise_workers_only(engine: RunningEngine) -> int:
    """Nodes other than 0 run workers only; they live as long as the job."""
    try:
        engine.supervisor.wait()
        return 0
    except ChildExited as error:
        return exit_with_failure(engine, error)


def generate(config: EngineConfig, args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as handle:
            prompts.extend(line.rstrip("\n") for line in handle if line.strip())
    if not prompts:
        print("spmdrun generate: give at least one --prompt or a --prompt-file", file=sys.stderr)
        return 2
    params = sampling_from_args(args)
    with RunningEngine(config, private_rpc=True) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            client = engine.connect()
            tokenizer = client.tokenizer
            token_lists = [client.encode(p) if args.no_chat_template else chat_prompt_ids(tokenizer, p)
                           for p in prompts]
            outputs = client.generate(token_lists, params)
        except (EngineError, ChildExited) as error:
            return exit_with_failure(engine, error)
        except ValueError as error:
            print(f"spmdrun generate: {error}", file=sys.stderr)
            return 2
    for output in outputs:
        print(output.text.strip(), flush=True)
    return 0


def serve(config: EngineConfig) -> int:
    with RunningEngine(config) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            engine.connect()
            print(f"spmdrun: serving {config.model} on {engine.config.rpc_address}", flush=True)
            engine.supervisor.wait()
        except (EngineError, ChildExited) as error:
            return exit_with_failure(engine, error)
    return 0


def bench(config: EngineConfig, args: argparse.Namespace) -> int:
    if args.bench_kind == "prefix":
        return bench_prefix(config, args)
    with RunningEngine(config, private_rpc=True) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            client = engine.connect()
            prompts = random_workload(args.num_requests, args.input_len_min, args.input_len_max,
                                      client.model_info().vocab_size, args.workload_seed)
            report = run_throughput(client, prompts, args.output_len, "spmd-runtime")
        except (EngineError, ChildExited) as error:
            return exit_with_failure(engine, error)
    print(TABLE_HEADER)
    print(report.row(), flush=True)
    if args.json:
        print(report.to_json(), flush=True)
    return 0


def bench_prefix(config: EngineConfig, args: argparse.Namespace) -> int:
    """The same shared-prefix workload through engines with prefix caching on and off.

    With several rounds the order alternates (on/off, off/on, ...) so that drift on a shared
    machine weighs on both settings alike; the totals of all rounds are compared.
    """
    runs: dict[bool, list[tuple]] = {True: [], False: []}
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for caching in order:
            engine_config = msgspec.structs.replace(config, enable_prefix_caching=caching)
            with RunningEngine(engine_config, private_rpc=True) as engine:
                if config.node_rank != 0:
                    return _supervise_workers_only(engine)
                try:
                    client = engine.connect()
                    prompts = shared_prefix_workload(
                        args.num_prefixes, args.prefix_len, args.suffix_len, args.repeat,
                        client.model_info().vocab_size, args.workload_seed)
                    report = run_throughput(client, prompts, args.output_len,
                                            f"prefix caching {'on' if caching else 'off'}")
                    stats = client.stats()
                except (EngineError, ChildExited) as error:
                    return exit_with_failure(engine, error)
            runs[caching].append((report, stats))
    print(f"{TABLE_HEADER} {'hit rate':>9}")
    for caching in (True, False):
        for report, stats in runs[caching]:
            print(f"{report.row()} {stats.prefix_cache_hit_rate:>9.1%}")
    seconds = {caching: sum(r.elapsed_s for r, _ in runs[caching]) for caching in runs}
    maintenance = sum(s.maintenance_ms for _, s in runs[True])
    hidden = sum(s.maintenance_hidden_ms for _, s in runs[True])
    print(f"input tok/s ratio (on / off, {args.rounds} round(s)): "
          f"{seconds[False] / seconds[True]:.2f}x; scheduler maintenance {maintenance:.1f} ms "
          f"in total, {hidden / maintenance if maintenance else 1.0:.1%} of it hidden behind "
          "the forward pass", flush=True)
    return 0
