"""The scheduler process: serves clients on a ROUTER socket and drives the workers step by step.

Its parts live beside it: rpc_front (the client socket), intake (requests in), startup (state
from the workers' reports), scheduler (what each step runs), streaming (results out)."""
from __future__ import annotations

import gc
import logging
import os
import signal
import time

import msgspec
import zmq
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import (
    AbortDone,
    AbortRequest,
    AddRequest,
    AdminBatchRequest,
    Done,
    ErrorReply,
    ModelInfo,
    ModelInfoRequest,
    ResetPrefixCacheRequest,
    StatsRequest,
    StepResult,
    WarmupPlan,
    WorkerLoaded,
    WorkersLost,
)
from spmd_runtime.protocol.transport import Encoder
from spmd_runtime.scheduler_proc.admin import admin_batch
from spmd_runtime.scheduler_proc.intake import RequestIntake
from spmd_runtime.scheduler_proc.request import FinishReason
from spmd_runtime.scheduler_proc.rpc_front import RpcFront
from spmd_runtime.scheduler_proc.scheduler import ScheduledStep, Scheduler, StepUpdate
from spmd_runtime.scheduler_proc.served_tokenizer import ServedTokenizer
from spmd_runtime.scheduler_proc.startup import (
    build_scheduler,
    derive_warmup_plan,
    kv_cache_manager,
)
from spmd_runtime.scheduler_proc.stats import StepTimes, engine_stats
from spmd_runtime.scheduler_proc.streaming import QuietClients, stream_update
from spmd_runtime.scheduler_proc.thermal import ThermalControl, load_policy_class
from spmd_runtime.scheduler_proc.worker_group import (
    GroupLost,
    Stopping,
    WorkerGroup,
    WorkersFailed,
)

log = logging.getLogger("spmd.scheduler")


class SchedulerServer:
    def __init__(self, config: EngineConfig) -> None:
        """Binds the RPC socket first: zmq.ZMQError naming the address when it cannot be had
        (another engine serves there), before any worker is waited for. Clients are answered
        pings from then on; everything else waits for the workers to be ready."""
        self.config = config
        self.ctx = zmq.Context()
        self.encoder = Encoder()
        try:
            self.front = RpcFront(config, self.ctx, self.encoder)
        except zmq.ZMQError:
            self.ctx.term()
            raise
        # The group's waits on workers end when a stop is requested (see stop()).
        self.group = WorkerGroup(config, self.ctx, self.encoder, lambda: self._stopping)
        self.tokenizer = ServedTokenizer(config.model)
        self.quiet = QuietClients()
        self.scheduler: Scheduler | None = None
        self.intake: RequestIntake | None = None
        self.model_info: ModelInfo | None = None
        # The buckets every rank warms up and the scheduler plans with, derived once.
        self.warmup: WarmupPlan | None = None
        # A step planned ahead and sent, whose result the next pass of the loop waits for.
        self._in_flight: ScheduledStep | None = None
        self._stopping = False
        self.invalid_requests = 0
        self.step_times = StepTimes()
        self.thermal_sensor = "none"
        # Fail at start-up, not at the first reading, if the policy cannot be loaded or built.
        policy_class = load_policy_class(config.thermal_policy)
        self.thermal = ThermalControl(policy_class(
            target_c=config.thermal_target_c, hysteresis_c=config.thermal_hysteresis_c,
            k_p=config.thermal_kp, victims=config.thermal_victims))
        if config.thermal_policy:
            log.info("thermal policy: %s", policy_class.__qualname__)

    # ------------------------------------------------------------------ start-up

    def _warmup_plan(self, loaded: WorkerLoaded) -> WarmupPlan:
        """Derived once, from the first rank to load: every rank of every generation warms up
        the same buckets."""
        if self.warmup is None:
            self.warmup = derive_warmup_plan(self.config, loaded)
        return self.warmup

    def _answer_clients_and_beat(self) -> None:
        self.group.heartbeat_if_due()
        self.front.receive()

    def wait_for_workers(self) -> None:
        ready = self.group.gather_ready(self._warmup_plan, while_waiting=self.front.receive)
        # Text prompts can be served once the tokenizer, loaded meanwhile, is there. Its first
        # conversion from a GGUF can outlast the workers' --heartbeat-timeout-s (18-23 s seen
        # on a busy 16-core machine): they hear from us all the while.
        self.tokenizer.wait(while_waiting=self._answer_clients_and_beat)
        self.scheduler, self.model_info = build_scheduler(self.config, ready, self.warmup,
                                                          self.thermal)
        self.intake = RequestIntake(self.scheduler, self.tokenizer, self.model_info)
        self.scheduler.constrained.configure(self.tokenizer.loaded, self.model_info.vocab_size,
                                             self.model_info.eos_token_ids)
        self.thermal_sensor = ready[0].thermal_sensor
        freeze_long_lived()
        log.info("serving on %s (KV cache: %d blocks of %d tokens, swap space: %d blocks, "
                 "max_model_len %d, scheduler %s, %d tokens a step)", self.front.address,
                 self.scheduler.num_kv_blocks, self.config.block_size,
                 self.scheduler.num_cpu_blocks, self.model_info.max_model_len,
                 self.config.scheduler, self.scheduler.max_num_batched_tokens)

    # ------------------------------------------------------------------ the step loop

    def run(self) -> None:
        assert self.scheduler is not None
        scheduler = self.scheduler
        try:
            stalled = False
            while not self._stopping:
                try:
                    stalled = self._iterate(scheduler, stalled)
                except GroupLost as lost:
                    self._in_flight = None
                    self._recover(lost.message)
                    stalled = False
        except Stopping:
            pass
        except WorkersFailed as error:
            log.error("%s", error)
            self._fail_everything(str(error))
            self.group.end_job(str(error))
            raise
        finally:
            self.group.shutdown()

    def _iterate(self, scheduler: Scheduler, stalled: bool) -> bool:
        """One pass of the step loop: send a step (unless one planned ahead is in flight),
        serve clients while the workers compute it, then stream its result. Returns whether
        it stalled (work waits but nothing could run)."""
        step = self._in_flight
        if step is None:
            step, stalled = self._next_step(scheduler, stalled)
        maintenance_ms = 0.0
        ahead = None
        if step is not None:
            started = time.perf_counter()
            # Plan the next step before this one's result, where it can be (pure decode
            # continuations), so the workers go on without waiting for this process.
            ahead = scheduler.schedule_ahead(step) if self.config.step_pipelining != "off" else None
            if ahead is not None:
                self.group.broadcast(self.encoder.encode(ahead.plan))
            scheduler.maintain(step)
            maintenance_ms = (time.perf_counter() - started) * 1e3
        # The one place client messages are acted on: with a step in flight, without blocking
        # (and with the requests the last result ended freed by the maintenance above). New
        # requests stop the pipeline (admitting them needs a planned step); aborts do not.
        self._serve_clients(block=step is None and (stalled or not scheduler.has_work))
        if step is None:
            return stalled
        result = self._receive_result(step)
        self._stream(scheduler.update(step, result))
        self.step_times.add_result(result, maintenance_ms, scheduler.has_work)
        self._in_flight = ahead
        return False

    def _next_step(self, scheduler: Scheduler,
                   stalled: bool) -> tuple[ScheduledStep | None, bool]:
        """Housekeeping between steps, then the step to send (sent), or None with whether the
        loop stalled."""
        if not scheduler.has_work:
            # Nothing in flight: finish pending frees before answering anyone.
            scheduler.maintain(None)
            self._send_to_workers_if_needed()
            self.group.heartbeat_if_due()
        self.group.drain()
        self.group.check_awaiting_launcher()
        if not scheduler.has_work:
            return None, False
        step = scheduler.schedule()
        # Nothing fits (validated inputs always fit an empty pool): wait, never spin.
        if not step.num_scheduled:
            self._send_to_workers_if_needed()
            return None, True
        self.group.broadcast(self.encoder.encode(step.plan))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d requests, %d tokens (%d waiting)", step.plan.step_id,
                      len(step.num_scheduled), step.num_tokens, len(scheduler.waiting))
        return step, False

    def _recover(self, message: WorkersLost) -> None:
        """Wait for the restarted worker group, then recompute everything that was in flight."""
        self.group.lost(message)
        ready = self.group.gather_ready(self._warmup_plan, while_waiting=self.front.receive)
        kv, num_cpu_blocks = kv_cache_manager(self.config, ready)
        gc.unfreeze()           # the old block pool may now be collected
        requeued = self.scheduler.restart(kv, num_cpu_blocks)
        freeze_long_lived()
        log.warning("worker group generation %d ready: %d requests recomputed from their "
                    "prompts and the tokens already streamed", self.group.generation, len(requeued))

    def _send_to_workers_if_needed(self) -> None:
        plan = self.scheduler.take_housekeeping_plan()
        if plan is not None:
            self.group.broadcast(self.encoder.encode(plan))

    def _receive_result(self, step: ScheduledStep) -> StepResult:
        deadline = time.monotonic() + self.config.step_timeout_s
        while True:
            if self._stopping:
                raise Stopping()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkersFailed(f"no result for step {step.plan.step_id} within "
                                    f"{self.config.step_timeout_s:.0f}s")
            # Pings are answered while the workers compute; other messages wait for the loop.
            self.front.receive()
            self.group.heartbeat_if_due()
            self.group.check_awaiting_launcher()
            message = self.group.poll(min(remaining, 0.05))
            if message is None:
                continue
            self.group.control_message(message)
            if isinstance(message, StepResult) and message.step_id == step.plan.step_id:
                return message

    # ------------------------------------------------------------------ clients

    def _serve_clients(self, block: bool) -> None:
        for client, message in self.front.take(block):
            self._handle_client_message(client, message)
        expired = self.intake.expire_deadlines()
        if expired:
            log.info("requests %s passed their deadline", [r.request_id for r in expired])
            self._stream(StepUpdate(finished=expired))

    def _handle_client_message(self, client: bytes, message: msgspec.Struct) -> None:
        if isinstance(message, AddRequest):
            reply = self.intake.add(client, message)
        elif isinstance(message, AbortRequest):
            reply = self._abort_request(message)
        elif isinstance(message, StatsRequest):
            reply = engine_stats(
                message.tag, self.scheduler, self.step_times, thermal_sensor=self.thermal_sensor,
                rejected_frames=self.front.rejected_frames,
                invalid_requests=self.invalid_requests)
        elif isinstance(message, ModelInfoRequest):
            reply = msgspec.structs.replace(self.model_info, tag=message.tag)
        elif isinstance(message, AdminBatchRequest):
            reply = admin_batch(self.config, self.scheduler, message)
        elif isinstance(message, ResetPrefixCacheRequest):
            reply = self._reset_prefix_cache(message)
        else:
            return
        if isinstance(reply, ErrorReply):
            # A decoded request that cannot be served: the error says what to change.
            self.invalid_requests += 1
        self.front.reply(client, reply)

    def _reset_prefix_cache(self, message: ResetPrefixCacheRequest) -> Done | ErrorReply:
        if self.scheduler.reset_prefix_cache():
            return Done(tag=message.tag)
        return ErrorReply(tag=message.tag, message=(
            f"cannot reset the prefix cache while {self.scheduler.num_kv_blocks_in_use} KV "
            "blocks are in use; retry when no request is running"))

    def _abort_request(self, message: AbortRequest) -> AbortDone | ErrorReply:
        request = self.scheduler.abort(message.request_id)
        if request is None:
            return ErrorReply(tag=message.tag, request_id=message.request_id,
                              message=f"unknown request id {message.request_id}: "
                                      "it never existed or has already finished")
        self._stream(StepUpdate(finished=[request]))
        return AbortDone(tag=message.tag, request_id=message.request_id)

    def _stream(self, update: StepUpdate) -> None:
        unreachable, stopped = stream_update(self.front, self.tokenizer, update, self.quiet)
        for request_id in stopped:
            self.scheduler.abort(request_id, FinishReason.STOP)
        for client in unreachable:
            self._abort_client(client)

    def _abort_client(self, client: bytes) -> None:
        """A client went away: its requests stop using the workers."""
        for request in self.scheduler.requests_of(client):
            self.scheduler.abort(request.request_id)
            self.tokenizer.forget(request.request_id)
            log.info("aborted request %d: its client disconnected", request.request_id)

    def _fail_everything(self, reason: str) -> None:
        if self.scheduler is None:
            return
        failed = self.scheduler.abort_all(FinishReason.ERROR)
        for request in failed:
            self.tokenizer.forget(request.request_id)
            self.front.reply(request.client, ErrorReply(
                tag=None, request_id=request.request_id, message=f"engine failed: {reason}"))

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self.front.close()
        self.group.close()
        self.ctx.term()


def freeze_long_lived() -> None:
    """Move what start-up built (the block pool's tens of thousands of blocks, the tokenizer)
    out of the collector's reach: a full collection would otherwise walk them all, a stall of
    milliseconds in some step (bench/scheduler_overhead.py --workload issue10)."""
    gc.collect()
    gc.freeze()


def serve(config: EngineConfig) -> int:
    """Process entry: wait for the workers, then serve until stopped. Returns an exit code."""
    try:
        server = SchedulerServer(config)
    except ValueError as error:     # a configuration the scheduler cannot work with
        log.error("%s", error)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    try:
        server.wait_for_workers()
        server.run()
        return 0
    except WorkersFailed as error:
        server.group.end_job(str(error))       # at start-up; run() has done it already
        return 1
    finally:
        server.close()
        log.info("scheduler (pid %d) stopped", os.getpid())
