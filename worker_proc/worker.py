"""Worker process loop: load the model, report readiness, then run step plans until shutdown."""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import psutil
import torch
import zmq
from spmd_runtime.protocol.auth import framed
from spmd_runtime.protocol.buckets import PhaseBuckets, graphs_enabled
from spmd_runtime.protocol.config import EngineConfig, with_step_budget
from spmd_runtime.protocol.curve import socket_keys
from spmd_runtime.protocol.env_vars import (
    SPMD_WORKER_GENERATION,
)
from spmd_runtime.protocol.messages import (
    Heartbeat,
    Shutdown,
    StepPlan,
    StepResult,
    WarmupPlan,
    WorkerError,
    WorkerLoaded,
    WorkerReady,
    worker_inbound_decoder,
)
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.protocol.process_entry import report_error, report_failure
from spmd_runtime.protocol.step_shape import Phase
from spmd_runtime.protocol.transport import Encoder, make_socket, poll_recv
from spmd_runtime.runtime.cpu_features import resolve_dtype_name
from spmd_runtime.runtime.preflight import resolved_quantization
from spmd_runtime.worker_proc.distributed import DistributedContext, init_distributed, shutdown_distributed
from spmd_runtime.worker_proc.drafting import Drafter
from spmd_runtime.worker_proc.kv_cache import allocate_kv_cache, allocate_pools, size_kv_cache
from spmd_runtime.worker_proc.liveness import start_liveness_beats
from spmd_runtime.worker_proc.model_loading import load_draft_model, load_worker_model
from spmd_runtime.worker_proc.model_runner import LaunchedStep, ModelRunner
from spmd_runtime.worker_proc.thermal import ThermalMonitor
from spmd_runtime.worker_proc.warmup import prepare_buckets, warm_up_unpadded

log = logging.getLogger("spmd.worker")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The worker's dtype for --dtype `name` on `device`, and why (see resolve_dtype_name)."""
    resolved, why = resolve_dtype_name(name, device.type)
    if resolved not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, float32, float16 or bfloat16")
    return DTYPES[resolved], why


# What the scheduler answers a rank's WorkerLoaded with: the buckets to warm up (None: off).
BucketsFromScheduler = Callable[[WorkerLoaded], dict[Phase, PhaseBuckets] | None]


def build_runner(config: EngineConfig, ctx: DistributedContext,
                 buckets_from_scheduler: BucketsFromScheduler | None = None
                 ) -> tuple[ModelRunner, WorkerReady]:
    """Load the model, allocate the KV cache and warm up the scheduler's buckets (asked for
    with `buckets_from_scheduler`; without it, none: the runner serves unpadded batches).
    --quantization auto is made concrete here too (spmdrun does it before any process starts;
    workers started by torchrun, or in process, get it as asked), and so is the step token
    budget (with_step_budget: its auto is this worker's device's)."""
    config, _ = resolved_quantization(config)
    config = with_step_budget(config, ctx.device.type)
    dtype, why = resolve_dtype(config.dtype, ctx.device)
    if ctx.rank == 0:
        log.info("dtype %s (%s)", str(dtype).removeprefix("torch."), why)
    model_config, model, tp, attention = load_worker_model(config, ctx, dtype)
    max_model_len = model_config.max_position_embeddings
    if config.max_model_len:
        max_model_len = min(max_model_len, config.max_model_len)
    max_useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    graphs = graphs_enabled(config, ctx.device.type) and not config.skip_warmup
    sizing = size_kv_cache(config, model, dtype, ctx.device, max_useful_blocks=max_useful,
                           local_world_size=local_world_size, graphs=graphs)
    log.info("rank %d memory: %s", ctx.rank,
             sizing.describe(config.block_size, config.gpu_memory_utilization, max_model_len))
    num_blocks = sizing.num_blocks
    if num_blocks < 1:
        raise RuntimeError(
            "no memory left for the KV cache: set --kv-cache-memory or --num-kv-blocks, raise "
            "--gpu-memory-utilization (CUDA), lower --max-num-batched-tokens, or use a smaller "
            "model")
    kv_caches, num_blocks, num_sliding, num_cpu_blocks = allocate_pools(
        config, model_config, sizing, max_useful, dtype, ctx.device, model.shards.num_kv_heads,
        ctx.rank)
    runner = ModelRunner(model, kv_caches, config.block_size, ctx.device,
                         seed=shared_sampling_seed(ctx), num_cpu_blocks=num_cpu_blocks,
                         scratch_block=num_blocks,
                         attention=attention)
    if config.speculative == "draft":
        runner.drafter = drafter_for(config, runner, model_config.vocab_size, num_blocks + 1,
                                     num_sliding + 1 if num_sliding else 0, dtype, ctx.device)
    generation = int(os.environ.get(SPMD_WORKER_GENERATION, "0"))
    loaded = WorkerLoaded(rank=ctx.rank, max_model_len=max_model_len, device=str(ctx.device),
                          generation=generation,
                          context_from_tensors=attention.reads_cache_in_place)
    buckets = buckets_from_scheduler(loaded) if buckets_from_scheduler else None
    prepare_buckets(runner, config, buckets, ctx,
                    graph_budget=sizing.graph_reserved_bytes if graphs else None)
    if buckets is None:
        warm_up_unpadded(runner, config, num_blocks, max_model_len, model_config.vocab_size, ctx)
    if num_cpu_blocks:
        log.info("rank %d swap space: %d CPU blocks (%.2f GiB%s)", ctx.rank, num_cpu_blocks,
                 config.kv_swap_memory / 2**30, ", pinned" if ctx.device.type == "cuda" else "")
    ready = WorkerReady(rank=ctx.rank, num_kv_blocks=num_blocks, max_model_len=max_model_len,
                        vocab_size=model_config.vocab_size,
                        eos_token_ids=list(model_config.eos_token_ids), device=str(ctx.device),
                        num_cpu_kv_blocks=num_cpu_blocks, generation=generation,
                        sliding_window=model_config.sliding_window or 0,
                        num_sliding_kv_blocks=num_sliding)
    return runner, ready


def drafter_for(config: EngineConfig, runner: ModelRunner, vocab_size: int, num_blocks: int,
                num_sliding_blocks: int, dtype: torch.dtype, device: torch.device) -> Drafter:
    """The draft model of --speculative draft, with a KV cache of its own in the target's
    block ids (as many blocks, in each pool where the target has two: its size is logged)."""
    draft_config, model = load_draft_model(config, device, dtype, vocab_size)
    check_draft_windows(config, draft_config, runner)
    kv_caches = allocate_kv_cache(draft_config, num_blocks, config.block_size, dtype, device,
                                  num_sliding_blocks=num_sliding_blocks,
                                  huge_pages=config.kv_cache_huge_pages)
    size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches)
    log.info("draft KV cache: %d blocks, %.2f GiB", num_blocks, size / 2**30)
    return Drafter(model, kv_caches, runner.inputs, runner.requests)


def check_draft_windows(config: EngineConfig, draft: ModelConfig, runner: ModelRunner) -> None:
    """The draft model attends through the target's block tables (its KV in the same block
    ids): each of its layers reads the table of the target's KV group with its window (or
    none), so every window it has must be one of the target's groups'. A full-attention draft
    serves a target mixing full and windowed layers (Gemma 2 and 3); one of the target's own
    family, the same. ValueError otherwise."""
    groups = runner.inputs.groups
    windows = {draft.window_of(i) for i in range(draft.num_hidden_layers)}
    if not windows <= {group.window for group in groups}:
        target = "mixes full layers and layers with a window of " \
            f"{groups[1].window}" if len(groups) > 1 else (
                f"attends with a window of {groups[0].window} on every layer" if groups[0].window
                else "has no sliding window")
        raise ValueError(f"--draft-model {config.draft_model} attends with windows "
                         f"{sorted(windows, key=str)}, --model {config.model} {target}: the draft "
                         "model reads the target's block tables, so each of its layers must "
                         "attend as one of the target's does; use --speculative ngram")


def shared_sampling_seed(ctx: DistributedContext) -> int:
    """A seed for requests without one, the same on every rank: each rank samples the same
    token from the same (gathered) logits and keeps it in its own request state."""
    seed = torch.randint(0, 2**62, (1,), device=ctx.device)
    if ctx.world_size > 1:
        torch.distributed.broadcast(seed, src=0)
    return int(seed.item())


def start_thermal_monitor(config: EngineConfig, ctx: DistributedContext) -> ThermalMonitor:
    monitor = ThermalMonitor.create(config.thermal_sensor, config.thermal_interval_steps,
                                    ctx.rank, ctx.world_size, ctx.device, config.dist_timeout_s)
    first = monitor.sensor.read()
    log.info("rank %d thermal sensor %s: %s", ctx.rank, monitor.sensor.kind,
             first.describe() if first else "no reading")
    return monitor


def set_cpu_threads(local_world_size: int) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else psutil.cpu_count()
    torch.set_num_threads(max(1, cores // max(1, local_world_size)))


def send(sock: zmq.Socket, config: EngineConfig, payload: bytes, flags: int = 0) -> None:
    """With --auth-token, every frame to the scheduler carries it."""
    sock.send_multipart(framed(config.auth_token, payload), flags)


class WorkerExit(Exception):
    """Leave the step loop with an exit code and, when it is a failure, the reason."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(code)
        self.code = code
        self.reason = reason


@dataclass
class InFlight:
    """A launched step whose result has not been sent yet."""

    step_id: int
    launched: LaunchedStep
    thermal: Future | None


class StepLoop:
    """Receive plans and run them; with --step-pipelining overlap, one step ahead.

    Overlapped, a step is launched on the device and, while it runs, the next plan (which the
    scheduler sends before this step's result where it plans ahead) is received, prepared on
    the host and launched behind it, its inputs taking this step's sampled tokens on the device.
    Only then does the worker wait for this step and send its result, so the device always has
    the next step queued. The host never waits for a plan while holding a finished step's
    result: the scheduler may be waiting for that result before it plans again.
    """

    # How often the socket and the step's completion are polled while the device runs it.
    POLL_S = 0.00005

    def __init__(self, sock: zmq.Socket, config: EngineConfig, encoder: Encoder, decoder,
                 runner: ModelRunner, monitor: ThermalMonitor, rank: int, parent: int) -> None:
        self.sock, self.config, self.encoder, self.decoder = sock, config, encoder, decoder
        self.runner, self.monitor, self.rank, self.parent = runner, monitor, rank, parent
        self.overlap = overlap_enabled(config, runner.device)
        # On a device that computes while the host goes on (CUDA), wait for the next plan only
        # as long as the step runs; on CPU, where launching a step runs it, overlap
        # takes a plan only if it is already there (this is how CPU tests exercise the path).
        self.device_runs_async = runner.device.type == "cuda"

    def run(self) -> None:
        # Until the scheduler is first heard from, it may still be starting (or waiting for
        # other nodes): wait as long as for the process group. Then heartbeats keep coming.
        silence_limit = self.config.dist_timeout_s
        last_heard = time.monotonic()
        in_flight: InFlight | None = None
        while True:
            if in_flight is not None:
                frames = self._poll_while_running(in_flight)
                if frames is None:
                    self._complete(in_flight)
                    in_flight = None
                    continue
            else:
                frames = poll_recv(self.sock, 1.0)
            if frames is None:
                if os.getppid() != self.parent:
                    raise WorkerExit(1, f"rank {self.rank}: the launcher is gone, exiting")
                if time.monotonic() - last_heard > silence_limit:
                    raise WorkerExit(1, f"rank {self.rank}: no plan or heartbeat from the "
                                        f"scheduler for {silence_limit:.0f}s: it is gone, "
                                        "exiting")
                continue
            last_heard = time.monotonic()
            silence_limit = self.config.heartbeat_timeout_s
            message = self.decoder.decode(frames[-1])
            if isinstance(message, Heartbeat):
                continue
            if isinstance(message, Shutdown):
                return
            assert isinstance(message, StepPlan)
            if in_flight is not None and not self.runner.can_prepare_ahead(message):
                self._complete(in_flight)
                in_flight = None
            prepared = self.runner.prepare(message)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("step %d: %s", message.step_id, prepared.describe())
            # The sensor reading and its all-reduce run beside the forward pass (in order, on
            # one thread: every rank starts the same collectives in the same order).
            thermal = self.monitor.begin(message.step_id)
            launched = self.runner.launch(prepared, in_flight.launched if in_flight else None)
            if in_flight is not None:
                self._complete(in_flight)
            in_flight = InFlight(message.step_id, launched, thermal)
            if not self.overlap:
                self._complete(in_flight)
                in_flight = None

    def _poll_while_running(self, in_flight: InFlight) -> list[bytes] | None:
        """The next frame if one arrives before the in-flight step is done; else None."""
        frames = poll_recv(self.sock, 0)
        while frames is None and self.device_runs_async and not in_flight.launched.is_done():
            time.sleep(self.POLL_S)
            frames = poll_recv(self.sock, 0)
        return frames

    def _complete(self, in_flight: InFlight) -> None:
        output = self.runner.finish(in_flight.launched)
        thermal = self.monitor.finish(in_flight.thermal)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d done: %s", in_flight.step_id, output.describe())
        if self.rank == 0 and in_flight.step_id >= 0:
            send(self.sock, self.config, self.encoder.encode(StepResult(
                step_id=in_flight.step_id, request_ids=output.request_ids,
                sampled_token_ids=output.sampled_token_ids, forward_ms=output.forward_ms,
                prepare_ms=output.prepare_ms, num_compilations=output.num_compilations,
                thermal=thermal, idle_ms=output.idle_ms,
                overlapped=output.overlapped, logprobs=output.logprobs,
                spec_token_ids=output.spec_token_ids,
                draft_proposals=output.draft_proposals)))


def ask_for_buckets(sock: zmq.Socket, config: EngineConfig, encoder: Encoder, decoder,
                    parent: int) -> BucketsFromScheduler:
    """Send WorkerLoaded and wait for the scheduler's WarmupPlan (heartbeats may come first):
    every rank warms up the buckets the scheduler derived, whatever its own environment."""

    def exchange(loaded: WorkerLoaded) -> dict[Phase, PhaseBuckets] | None:
        send(sock, config, encoder.encode(loaded))
        deadline = time.monotonic() + config.dist_timeout_s
        while True:
            frames = poll_recv(sock, 1.0)
            if frames is None:
                if os.getppid() != parent:
                    raise WorkerExit(1, f"rank {loaded.rank}: the launcher is gone, exiting")
                if time.monotonic() > deadline:
                    raise WorkerExit(1, f"rank {loaded.rank}: no warmup plan from the scheduler "
                                        f"in {config.dist_timeout_s:.0f}s: it is gone, exiting")
                continue
            message = decoder.decode(frames[-1])
            if isinstance(message, WarmupPlan):
                return message.buckets
            if isinstance(message, Shutdown):
                raise WorkerExit(0)

    return exchange


def overlap_enabled(config: EngineConfig, device: torch.device) -> bool:
    """--step-pipelining overlap; auto overlaps on CUDA, where the device runs while the host
    prepares."""
    if config.step_pipelining == "auto":
        return device.type == "cuda"
    return config.step_pipelining == "overlap"


def run_worker(config: EngineConfig) -> int:
    """Process entry; returns the exit code."""
    ctx_zmq = zmq.Context()
    rank = int(os.environ.get("RANK", "0"))
    sock = make_socket(ctx_zmq, zmq.DEALER, config.worker_address, bind=False,
                       identity=f"rank-{rank}".encode(),
                       curve=socket_keys(config.curve_keys, config.worker_address, server=False))
    encoder = Encoder()
    decoder = worker_inbound_decoder()
    parent = os.getppid()
    # Until the process group is formed, this rank may be blocked in C++ waiting for its peers,
    # where no Python handler runs: a stop (or Ctrl-C) then ends it at once, silently.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if config.nnodes > 1:
        start_liveness_beats(config, rank, int(os.environ.get(SPMD_WORKER_GENERATION, "0")))
    try:
        ctx = init_distributed(config.device, config.dist_backend, config.dist_timeout_s)
        # From here a stop from the launcher ends the loop through the finally block below.
        # Ctrl-C in a terminal signals the whole process group: a stop too, not an interrupt.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
        if ctx.device.type == "cpu":
            set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        runner, ready = build_runner(config, ctx,
                                     ask_for_buckets(sock, config, encoder, decoder, parent))
        monitor = start_thermal_monitor(config, ctx)
        ready.thermal_sensor = monitor.sensor.kind
        send(sock, config, encoder.encode(ready))
        StepLoop(sock, config, encoder, decoder, runner, monitor, ctx.rank, parent).run()
        return 0
    except WorkerExit as stop:
        if stop.reason:
            report_error(stop.reason)
        return stop.code
    except Exception as error:
        # The line goes first (report_failure): the scheduler exits as soon as it hears.
        code, detail = report_failure(error, f"rank {rank}", log)
        try:
            send(sock, config, encoder.encode(WorkerError(
                rank=rank, message=detail,
                generation=int(os.environ.get(SPMD_WORKER_GENERATION, "0")))),
                 zmq.NOBLOCK)
            time.sleep(0.2)  # let the error frame leave before the socket closes
        except zmq.ZMQError:
            pass
        return code
    finally:
        # Exiting anyway: a late SIGTERM from the launcher must not interrupt the clean-up.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sock.close(linger=0)
        ctx_zmq.term()
        shutdown_distributed()
