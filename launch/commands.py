"""The subcommands: generate, serve, bench."""
from __future__ import annotations

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
)
from spmd_runtime.launch.bench_serving import ServingReport, measure, served_model
from spmd_runtime.launch.command_options import (
    CommandOptions,
    GenerateOptions,
    PrefixBenchOptions,
    PressureBenchOptions,
    ServeOptions,
    ServingBenchOptions,
    ThroughputBenchOptions,
)
from spmd_runtime.launch.http_front import start_http_front
from spmd_runtime.launch.progress import generate_with_progress
from spmd_runtime.launch.running import RunningEngine, exit_with_failure
from spmd_runtime.launch.supervisor import ChildExited, JobEnded
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import EngineStats
from spmd_runtime.protocol.transport import free_tcp_port
from spmd_runtime.runtime.client import EngineError
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.preflight import ConfigError


def _supervise_workers_only(engine: RunningEngine) -> int:
    """Nodes other than 0 run workers only; they live as long as the job. A worker that exits
    with code 0 was shut down by node 0's scheduler: the job is over, and once this node's other
    workers have followed, so is this launcher (exit code 0)."""
    try:
        engine.supervisor.wait()
        return 0
    except JobEnded as error:
        print(f"spmdrun: error: {error}", file=sys.stderr, flush=True)
        return 1
    except ChildExited as error:
        if error.code == 0 and engine.supervisor.wait_all_exited(timeout_s=30.0) == 0:
            print(f"spmdrun: node {engine.config.node_rank}: the job ended (node 0 shut its "
                  "workers down)", file=sys.stderr, flush=True)
            return 0
        return exit_with_failure(engine, error)


def run_command(config: EngineConfig, options: CommandOptions) -> int:
    """Run the subcommand those options belong to; its exit code."""
    if isinstance(options, GenerateOptions):
        return generate(config, options)
    if isinstance(options, ServeOptions):
        return serve(config)
    if isinstance(options, ThroughputBenchOptions):
        return bench_throughput(config, options)
    if isinstance(options, PrefixBenchOptions):
        return bench_prefix(config, options)
    if isinstance(options, PressureBenchOptions):
        return bench_pressure(config, options)
    return bench_serving(config, options)


def generate(config: EngineConfig, options: GenerateOptions) -> int:
    """The prompts (text) with the sampling options; each answer is printed as it completes."""
    with RunningEngine(config, private_rpc=True) as engine:
        if config.node_rank != 0:
            return _supervise_workers_only(engine)
        try:
            engine.connect()

            def answer(index: int, output: RequestOutput) -> str:
                return answer_line(options.output, index, options.prompts, output)

            # The engine applies the chat template, tokenizes and decodes: no tokenizer here.
            generate_with_progress(engine.config.rpc_address, options.prompts, options.sampling,
                                   "generate", alive=engine.alive,
                                   auth_token=engine.config.auth_token, on_output=answer,
                                   chat=options.chat_template)
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


def bench_throughput(config: EngineConfig, options: ThroughputBenchOptions) -> int:
    workload = options.workload
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
    if options.with_peer:
        # Our engine's processes have exited: the peer has the device to itself.
        sizes = hf_peer.same_sizes(config) if options.peer_cache == "same" else {}
        try:
            reports.append(hf_peer.run_transformers(config.model, prompts, output_lens,
                                                 dtype=config.dtype, device=config.device,
                                                 seed=config.dummy_seed, api=options.peer_api,
                                                 threads=options.peer_threads, **sizes))
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
    if options.json:
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


def bench_prefix(config: EngineConfig, options: PrefixBenchOptions) -> int:
    """The same shared-prefix workload through engines with prefix caching on and off."""
    variants = [(f"prefix caching {'on' if caching else 'off'}",
                 msgspec.structs.replace(config, enable_prefix_caching=caching))
                for caching in (True, False)]
    runs = _run_variants(variants, lambda vocab: shared_prefix_workload(
        options.num_prefixes, options.prefix_len, options.suffix_len, options.repeat, vocab,
        options.workload_seed), options.output_len, options.rounds)
    if isinstance(runs, int):
        return runs
    on, off = runs.values()
    print(f"{TABLE_HEADER} {'hit rate':>9}")
    for report, stats in on + off:
        print(f"{report.row()} {stats.prefix_cache_hit_rate:>9.1%}")
    maintenance = sum(s.maintenance_ms for _, s in on)
    hidden = sum(s.maintenance_hidden_ms for _, s in on)
    print(f"input tok/s ratio (on / off, {options.rounds} round(s)): "
          f"{_total_seconds(off) / _total_seconds(on):.2f}x; scheduler maintenance "
          f"{maintenance:.1f} ms in total, {hidden / maintenance if maintenance else 1.0:.1%} of "
          "it hidden behind the forward pass", flush=True)
    return 0


def bench_pressure(config: EngineConfig, options: PressureBenchOptions) -> int:
    """Random prompts through a roomy KV pool and through a small one, where requests are
    preempted by offload to the CPU swap space or by soft reset."""
    small = msgspec.structs.replace(config, num_kv_blocks=options.pressure_blocks)
    variants = [("roomy pool", config),
                (f"offload ({options.swap_space_gib:g} GiB)",
                 msgspec.structs.replace(
                     small, kv_swap_memory=int(options.swap_space_gib * 2**30))),
                ("soft reset", msgspec.structs.replace(small, kv_swap_memory=0))]
    runs = _run_variants(variants, lambda vocab: random_workload(
        options.num_requests, options.input_len_min, options.input_len_max, vocab, options.workload_seed),
        options.output_len, options.rounds)
    if isinstance(runs, int):
        return runs
    print(f"{TABLE_HEADER} {'preempt':>8} {'swap out':>8} {'resets':>7} {'vs roomy':>9}")
    roomy_seconds = _total_seconds(runs["roomy pool"])
    for label_runs in runs.values():
        ratio = roomy_seconds / _total_seconds(label_runs)
        for report, stats in label_runs:
            print(f"{report.row()} {stats.num_preemptions:>8} {stats.num_swaps_out:>8} "
                  f"{stats.num_soft_resets:>7} {ratio:>8.2f}x")
    print(f"small pool: {options.pressure_blocks} blocks of {config.block_size} tokens for "
          f"{options.num_requests} requests of up to {options.input_len_max + options.output_len} tokens; "
          f"'vs roomy' is output tok/s relative to the roomy pool over {options.rounds} round(s)",
          flush=True)
    return 0


def bench_serving(config: EngineConfig, options: ServingBenchOptions) -> int:
    """Online load against a running server (--url), or against an engine started here."""
    if options.num_requests < 1 or options.output_len < 1 or not options.request_rate > 0:
        raise ConfigError("--num-requests, --output-len and --request-rate must be positive")
    if options.url:
        try:
            report = asyncio.run(_serving_load(options.url, options, None, config.auth_token))
        except (EngineError, RuntimeError, OSError, ValueError) as error:
            print(f"spmdrun bench serving: {error}", file=sys.stderr)
            return 1
    else:
        if options.endpoint == "http" and not config.http_port:
            config = msgspec.structs.replace(config, http_port=free_tcp_port(config.http_host))
        with RunningEngine(config, private_rpc=True) as engine:
            if config.node_rank != 0:
                return _supervise_workers_only(engine)
            try:
                engine.connect()
                url = engine.config.rpc_address
                if options.endpoint == "http":
                    url = start_http_front(engine.config, engine.supervisor, engine.alive)
                report = asyncio.run(_serving_load(url, options, engine.alive,
                                                   engine.config.auth_token))
            except (EngineError, ChildExited, RuntimeError) as error:
                return exit_with_failure(engine, error)
    print(report.table(), flush=True)
    if options.json:
        print(json.dumps(report.summary()), flush=True)
    return 0


async def _serving_load(url: str, options: ServingBenchOptions, alive,
                        auth_token: str) -> ServingReport:
    endpoint = "http" if url.startswith(("http://", "https://")) else "rpc"
    model, vocab_size = await served_model(url, auth_token)
    if options.dataset == "random":
        prompts = random_workload(options.num_requests, options.input_len_min, options.input_len_max,
                                  vocab_size, options.workload_seed)
    else:
        repeat = -(-options.num_requests // options.num_prefixes)
        prompts = shared_prefix_workload(options.num_prefixes, options.prefix_len, options.suffix_len,
                                         repeat, vocab_size, options.workload_seed)[:options.num_requests]
    return await measure(endpoint, url.rstrip("/"), model, prompts, options.output_len,
                         options.request_rate, options.max_concurrency, options.workload_seed, alive,
                         auth_token)
