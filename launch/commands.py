"""The subcommands: generate, serve, bench."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable

import msgspec
from spmd_runtime.launch import hf_peer
from spmd_runtime.launch.bench import (
    TABLE_HEADER,
    ThroughputReport,
    random_workload,
    run_throughput,
    shared_prefix_workload,
    throughput_workload_from_args,
)
from spmd_runtime.launch.bench_serving import ServingReport, measure, served_model
from spmd_runtime.launch.http_front import start_http_front
from spmd_runtime.launch.progress import generate_with_progress
from spmd_runtime.launch.running import RunningEngine, exit_with_failure
from spmd_runtime.launch.supervisor import ChildExited
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import EngineStats
from spmd_runtime.protocol.model_source import DUMMY_PREFIX
from spmd_runtime.protocol.transport import free_tcp_port
from spmd_runtime.runtime.client import EngineError
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.preflight import ConfigError


def _supervise_workers_only(engine: RunningEngine) -> int:
    """Nodes other than 0 run workers only; they live as long as the job."""
    try:
        engine.supervisor.wait()
        return 0
    except ChildExited as error:
        return exit_with_failure(engine, error)


def generate(config: EngineConfig, args: argparse.Namespace) -> int:
    """args.prompts (text) with args.sampling; each answer is printed as it completes."""
    with RunningEngine(config, private_rpc=True) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            engine.connect()

            def answer(index: int, output: RequestOutput) -> str:
                return answer_line(args.output, index, args.prompts, output)

            # The engine applies the chat template, tokenizes and decodes: no tokenizer here.
            generate_with_progress(engine.config.rpc_address, args.prompts, args.sampling,
                                   "generate", alive=engine.alive,
                                   auth_token=engine.config.auth_token, on_output=answer,
                                   chat=not args.no_chat_template)
        except (EngineError, ChildExited) as error:
            return exit_with_failure(engine, error)
        except ValueError as error:            # a prompt the engine refuses (too long, ...)
            raise ConfigError(str(error)) from None
    return 0


def answer_line(output_format: str, index: int, prompts: list[str], output: RequestOutput) -> str:
    """An answer as `generate --output` prints it: its text (after [index] when there are
    several prompts), or a JSON object."""
    if output_format == "jsonl":
        return json.dumps({"index": index, "prompt": prompts[index], "text": output.text,
                           "token_ids": output.token_ids, "finish_reason": output.finish_reason})
    text = output.text.strip()
    return f"[{index}] {text}" if len(prompts) > 1 else text


def serve(config: EngineConfig) -> int:
    with RunningEngine(config) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            engine.connect()
            if config.http_port:
                url = start_http_front(engine.config, engine.supervisor, engine.alive)
                print(f"spmdrun: HTTP front on {url}", flush=True)
            print(f"spmdrun: serving {config.model} on {engine.config.rpc_address}", flush=True)
            engine.supervisor.wait()
        except (EngineError, ChildExited, RuntimeError) as error:
            return exit_with_failure(engine, error)
    return 0


def bench(config: EngineConfig, args: argparse.Namespace) -> int:
    if args.bench_kind == "serving":
        return bench_serving(config, args)
    if args.bench_kind == "prefix":
        return bench_prefix(config, args)
    if args.bench_kind == "pressure":
        return bench_pressure(config, args)
    return bench_throughput(config, args)


def bench_model(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """Apply the bench spellings of the model: --model-config PRESET is --model dummy:PRESET,
    --load-format dummy turns --model NAME into dummy:NAME."""
    model = config.model
    if args.model_config:
        if "model" in args:
            raise ConfigError("give --model or --model-config, not both")
        model = args.model_config
    if (args.load_format == "dummy" or args.model_config) and not model.startswith(DUMMY_PREFIX):
        model = DUMMY_PREFIX + model
    return msgspec.structs.replace(config, model=model)


def bench_throughput(config: EngineConfig, args: argparse.Namespace) -> int:
    try:
        workload = throughput_workload_from_args(args)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    output_lens = workload.output_lens()
    with RunningEngine(config, private_rpc=True) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            client = engine.connect()
            prompts = workload.prompts(client.model_info().vocab_size)
            report = run_throughput(client, prompts, output_lens, "spmd-runtime", engine.alive,
                                    engine.config.auth_token)
            stats = client.stats()
        except (EngineError, ChildExited) as error:
            return exit_with_failure(engine, error)
    reports, failure = [report], None
    if args.with_peer:
        # Our engine's processes have exited: the peer has the device to itself.
        sizes = hf_peer.same_sizes(config) if args.peer_cache == "same" else {}
        try:
            reports.append(hf_peer.run_transformers(config.model, prompts, output_lens,
                                                 dtype=config.dtype, device=config.device,
                                                 seed=config.dummy_seed, **sizes))
        except (RuntimeError, ImportError, ValueError) as error:  # CUDA OOM is a RuntimeError
            failure = f"spmdrun bench throughput: the transformers run failed: {error}"
    print(TABLE_HEADER)
    for row in reports:
        print(row.row(), flush=True)
    print(f"workload: {workload.describe()}, seed {workload.seed}; model {config.model}", flush=True)
    if len(reports) > 1:
        print(f"output tok/s ratio (spmd-runtime / transformers): "
              f"{report.output_tokens_per_s / reports[1].output_tokens_per_s:.2f}x", flush=True)
    print(f"steps: {stats.num_steps} ({stats.num_overlapped_steps} overlapped), device idle "
          f"{stats.device_idle_fraction:.1%} between back-to-back steps ({stats.device_idle_ms:.0f} "
          f"ms idle, {stats.device_busy_ms:.0f} ms busy, as rank 0 timed them); scheduler view: "
          f"{stats.step_wall_ms:.0f} ms from result to result, {stats.step_forward_ms:.0f} ms of it "
          f"forward passes", flush=True)
    if stats.bucketing:
        print(f"buckets: {stats.runtime_graph_compilations} compilations after warmup, "
              f"{stats.batches_outside_buckets} batches outside every bucket, padding waste "
              f"{stats.padding_waste:.1%} of computed tokens", flush=True)
    if args.json:
        for row in reports:
            print(row.to_json(), flush=True)
    if failure:
        print(failure, file=sys.stderr)
        return 1
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
                    report = run_throughput(client, prompts, output_len, label, engine.alive,
                                            engine.config.auth_token)
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


def bench_serving(config: EngineConfig, args: argparse.Namespace) -> int:
    """Online load against a running server (--url), or against an engine started here."""
    if args.num_requests < 1 or args.output_len < 1 or not args.request_rate > 0:
        raise ConfigError("--num-requests, --output-len and --request-rate must be positive")
    if args.url:
        try:
            report = asyncio.run(_serving_load(args.url, args, None, config.auth_token))
        except (EngineError, RuntimeError, OSError, ValueError) as error:
            print(f"spmdrun bench serving: {error}", file=sys.stderr)
            return 1
    else:
        if args.endpoint == "http" and not config.http_port:
            config = msgspec.structs.replace(config, http_port=free_tcp_port(config.http_host))
        with RunningEngine(config, private_rpc=True) as engine:
            if config.node_rank != 0:
                return _supervise_workers_only(engine)
            try:
                engine.connect()
                url = engine.config.rpc_address
                if args.endpoint == "http":
                    url = start_http_front(engine.config, engine.supervisor, engine.alive)
                report = asyncio.run(_serving_load(url, args, engine.alive,
                                                   engine.config.auth_token))
            except (EngineError, ChildExited, RuntimeError) as error:
                return exit_with_failure(engine, error)
    print(report.table(), flush=True)
    if args.json:
        print(json.dumps(report.summary()), flush=True)
    return 0


async def _serving_load(url: str, args: argparse.Namespace, alive,
                        auth_token: str) -> ServingReport:
    endpoint = "http" if url.startswith(("http://", "https://")) else "rpc"
    model, vocab_size = await served_model(url, auth_token)
    if args.dataset == "random":
        prompts = random_workload(args.num_requests, args.input_len_min, args.input_len_max,
                                  vocab_size, args.workload_seed)
    else:
        repeat = -(-args.num_requests // args.num_prefixes)
        prompts = shared_prefix_workload(args.num_prefixes, args.prefix_len, args.suffix_len,
                                         repeat, vocab_size, args.workload_seed)[:args.num_requests]
    return await measure(endpoint, url.rstrip("/"), model, prompts, args.output_len,
                         args.request_rate, args.max_concurrency, args.workload_seed, alive,
                         auth_token)
