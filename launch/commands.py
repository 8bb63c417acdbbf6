"""The subcommands: generate, serve, bench."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import msgspec

from launch.bench import (
    TABLE_HEADER,
    ThroughputReport,
    random_workload,
    run_throughput,
    shared_prefix_workload,
)
from launch.cli import sampling_from_args
from launch.running import RunningEngine, exit_with_failure
from launch.supervisor import ChildExited
from protocol.config import EngineConfig
from protocol.messages import EngineStats
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
    if args.bench_kind == "pressure":
        return bench_pressure(config, args)
    with RunningEngine(config, private_rpc=True) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            client = engine.connect()
            prompts = random_workload(args.num_requests, args.input_len_min, args.input_len_max,
                                      client.model_info().vocab_size, args.workload_seed)
            report = run_throughput(client, prompts, args.output_len, "spmd-runtime")
            stats = client.stats()
        except (EngineError, ChildExited) as error:
            return exit_with_failure(engine, error)
    print(TABLE_HEADER)
    print(report.row(), flush=True)
    if stats.bucketing:
        print(f"buckets: {stats.runtime_graph_compilations} compilations after warmup, "
              f"{stats.batches_outside_buckets} batches outside every bucket, padding waste "
              f"{stats.padding_waste:.1%} of computed tokens", flush=True)
    if args.json:
        print(report.to_json(), flush=True)
    return 0


Workload = Callable[[int], list[list[int]]]   # vocabulary size -> prompts


def _run_variants(variants: list[tuple[str, EngineConfig]], workload: Workload, output_len: int,
                  rounds: int) -> dict[str, list[tuple[ThroughputReport, EngineStats]]] | int:
    """The same workload through one engine per variant, `rounds` times; the order rotates each
    round so that drift on a shared machine weighs on every variant alike. Returns the runs per
    label, or an exit code if an engine failed."""
    runs: dict[str, list] = {label: [] for label, _ in variants}
    for round_index in range(rounds):
        shift = round_index % len(variants)
        for label, engine_config in variants[shift:] + variants[:shift]:
            with RunningEngine(engine_config, private_rpc=True) as engine:
                if engine_config.node_rank != 0:
                    return _supervise_workers_only(engine)
                try:
                    client = engine.connect()
                    prompts = workload(client.model_info().vocab_size)
                    report = run_throughput(client, prompts, output_len, label)
                    stats = client.stats()
                except (EngineError, ChildExited) as error:
                    return exit_with_failure(engine, error)
            runs[label].append((report, stats))
    return runs


def _total_seconds(runs: list[tuple[ThroughputReport, EngineStats]]) -> float:
    return sum(report.elapsed_s for report, _ in runs)


def bench_prefix(config: EngineConfig, args: argparse.Namespace) -> int:
    """The same shared-prefix workload through engines with prefix caching on and off."""
    variants = [(f"prefix caching {'on' if caching else 'off'}",
                 msgspec.structs.replace(config, enable_prefix_caching=caching))
                for caching in (True, False)]
    runs = _run_variants(variants, lambda vocab: shared_prefix_workload(
        args.num_prefixes, args.prefix_len, args.suffix_len, args.repeat, vocab,
        args.workload_seed), args.output_len, args.rounds)
    if isinstance(runs, int):
        return runs
    on, off = runs.values()
    print(f"{TABLE_HEADER} {'hit rate':>9}")
    for report, stats in on + off:
        print(f"{report.row()} {stats.prefix_cache_hit_rate:>9.1%}")
    maintenance = sum(s.maintenance_ms for _, s in on)
    hidden = sum(s.maintenance_hidden_ms for _, s in on)
    print(f"input tok/s ratio (on / off, {args.rounds} round(s)): "
          f"{_total_seconds(off) / _total_seconds(on):.2f}x; scheduler maintenance "
          f"{maintenance:.1f} ms in total, {hidden / maintenance if maintenance else 1.0:.1%} of "
          "it hidden behind the forward pass", flush=True)
    return 0


def bench_pressure(config: EngineConfig, args: argparse.Namespace) -> int:
    """Random prompts through a roomy KV pool and through a small one, where requests are
    preempted by offload to the CPU swap space or by soft reset."""
    small = msgspec.structs.replace(config, num_kv_blocks=args.pressure_blocks)
    variants = [("roomy pool", config),
                (f"offload ({args.swap_space_gib:g} GiB)",
                 msgspec.structs.replace(small, swap_space=args.swap_space_gib)),
                ("soft reset", msgspec.structs.replace(small, swap_space=0.0))]
    runs = _run_variants(variants, lambda vocab: random_workload(
        args.num_requests, args.input_len_min, args.input_len_max, vocab, args.workload_seed),
        args.output_len, args.rounds)
    if isinstance(runs, int):
        return runs
    print(f"{TABLE_HEADER} {'preempt':>8} {'swap out':>8} {'resets':>7} {'vs roomy':>9}")
    roomy_seconds = _total_seconds(runs["roomy pool"])
    for label_runs in runs.values():
        ratio = roomy_seconds / _total_seconds(label_runs)
        for report, stats in label_runs:
            print(f"{report.row()} {stats.num_preemptions:>8} {stats.num_swaps_out:>8} "
                  f"{stats.num_soft_resets:>7} {ratio:>8.2f}x")
    print(f"small pool: {args.pressure_blocks} blocks of {config.block_size} tokens for "
          f"{args.num_requests} requests of up to {args.input_len_max + args.output_len} tokens; "
          f"'vs roomy' is output tok/s relative to the roomy pool over {args.rounds} round(s)",
          flush=True)
    return 0
