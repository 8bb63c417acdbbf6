"""The scheduler process: serves clients on a ROUTER socket and drives the workers step by step."""
from __future__ import annotations

import heapq
import logging
import os
import signal
import time

import msgspec
import zmq
from spmd_runtime.protocol.buckets import bucketing_enabled, engine_buckets
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
    Outputs,
    RequestAccepted,
    RequestDelta,
    ResetPrefixCacheRequest,
    StatsRequest,
    StepResult,
    WarmupPlan,
    WorkerLoaded,
    WorkerReady,
    WorkersLost,
)
from spmd_runtime.protocol.transport import Encoder
from spmd_runtime.scheduler_proc.admin import admin_batch
from spmd_runtime.scheduler_proc.admission import refusal
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.request import FinishReason, Request
from spmd_runtime.scheduler_proc.rpc_front import RpcFront
from spmd_runtime.scheduler_proc.scheduler import ScheduledStep, Scheduler, StepUpdate
from spmd_runtime.scheduler_proc.served_tokenizer import ServedTokenizer
from spmd_runtime.scheduler_proc.stats import StepTimes, engine_stats
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
        self.scheduler: Scheduler | None = None
        self.model_info: ModelInfo | None = None
        # The buckets every rank warms up and the scheduler plans with, derived once.
        self.warmup: WarmupPlan | None = None
        self._next_request_id = 0
        self._arrivals = 0
        self._stopping = False
        self.invalid_requests = 0
        # (deadline, request id, arrival) of requests with a timeout, soonest first.
        self._deadlines: list[tuple[float, int, int]] = []
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

    def _kv_cache_manager(self, ready: dict[int, WorkerReady]) -> tuple[KVCacheManager, int]:
        num_blocks = min(r.num_kv_blocks for r in ready.values())
        num_cpu_blocks = min(r.num_cpu_kv_blocks for r in ready.values())
        kv = KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        return kv, num_cpu_blocks

    def _warmup_plan(self, loaded: WorkerLoaded) -> WarmupPlan:
        """The buckets of this engine, derived once, from the configuration, this process's
        environment and the first rank to load (its model's context length and device): every
        rank of every generation warms up the same ones."""
        if self.warmup is None:
            buckets = None
            if bucketing_enabled(self.config, loaded.device.split(":")[0]):
                buckets = engine_buckets(self.config, loaded.max_model_len)
            self.warmup = WarmupPlan(buckets=buckets)
        return self.warmup

    def wait_for_workers(self) -> None:
        world = self.config.world_size
        ready = self.group.gather_ready(self._warmup_plan, while_waiting=self.front.receive)
        # Text prompts can be served once the tokenizer, loaded meanwhile, is there.
        self.tokenizer.wait(while_waiting=self.front.receive)
        first = ready[0]
        kv, num_cpu_blocks = self._kv_cache_manager(ready)
        num_blocks = kv.num_blocks
        block_size = self.config.block_size
        max_model_len = min(first.max_model_len, num_blocks * block_size)
        if self.config.max_model_len:
            max_model_len = min(max_model_len, self.config.max_model_len)
        buckets = self.warmup.buckets if self.warmup is not None else None
        self.scheduler = Scheduler(
            kv, max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, max_model_len=max_model_len,
            eos_token_ids=first.eos_token_ids, policy=self.config.scheduler,
            num_cpu_blocks=num_cpu_blocks, admission_watermark=self.config.kv_admission_watermark,
            buckets=buckets, thermal=self.thermal)
        self.thermal_sensor = first.thermal_sensor
        self.model_info = ModelInfo(tag=0, model=self.config.model, max_model_len=max_model_len,
                                    vocab_size=first.vocab_size, eos_token_ids=first.eos_token_ids,
                                    block_size=block_size, world_size=world,
                                    served_model_name=self.config.served_name())
        log.info("serving on %s (KV cache: %d blocks of %d tokens, swap space: %d blocks, "
                 "max_model_len %d, scheduler %s)", self.front.address, num_blocks,
                 block_size, num_cpu_blocks, max_model_len, self.config.scheduler)

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
                    self._recover(lost.message)
                    stalled = False
        except Stopping:
            pass
        except WorkersFailed as error:
            log.error("%s", error)
            self._fail_everything(str(error))
            raise
        finally:
            self.group.shutdown()

    def _iterate(self, scheduler: Scheduler, stalled: bool) -> bool:
        """One pass of the step loop; returns whether it stalled (nothing could run)."""
        if not scheduler.has_work:
            # Nothing in flight: finish pending frees before answering anyone.
            scheduler.maintain(None)
            self._send_to_workers_if_needed()
            self.group.heartbeat_if_due()
        self.group.drain()
        self.group.check_awaiting_launcher()
        self._handle_client_messages(block=stalled or not scheduler.has_work)
        self._expire_deadlines()
        if not scheduler.has_work:
            return False
        step = scheduler.schedule()
        # Nothing fits (validated inputs always fit an empty pool): wait, never spin.
        if not step.num_scheduled:
            self._send_to_workers_if_needed()
            return True
        self.group.broadcast(self.encoder.encode(step.plan))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d requests, %d tokens (%d waiting)", step.plan.step_id,
                      len(step.num_scheduled), step.num_tokens, len(scheduler.waiting))
        planned_ahead = False
        while step is not None:
            started = time.perf_counter()
            # Plan the next step before this one's result, where it can be (pure decode
            # continuations), so the workers go on without waiting for this process.
            ahead = scheduler.schedule_ahead(step) if self.config.async_scheduling else None
            if ahead is not None:
                self.group.broadcast(self.encoder.encode(ahead.plan))
            scheduler.maintain(step)
            maintenance_ms = (time.perf_counter() - started) * 1e3
            if planned_ahead:
                # Past the first step: answer clients here, without blocking, as the loop
                # would between steps (with the requests the last result ended freed by the
                # maintenance above). New requests stop the pipeline (admitting them needs a
                # planned step); aborts do not. No group.drain(): a result may be waiting.
                self._handle_client_messages(block=False)
                self._expire_deadlines()
            result = self._receive_result(step)
            self._stream(scheduler.update(step, result))
            self.step_times.add_result(result, maintenance_ms, scheduler.has_work)
            step, planned_ahead = ahead, True
        return False

    def _recover(self, message: WorkersLost) -> None:
        """Wait for the restarted worker group, then recompute everything that was in flight."""
        self.group.lost(message)
        ready = self.group.gather_ready(self._warmup_plan, while_waiting=self.front.receive)
        kv, num_cpu_blocks = self._kv_cache_manager(ready)
        requeued = self.scheduler.restart(kv, num_cpu_blocks)
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
            # Keep accepting clients while the workers compute; their messages wait for the loop.
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

    def _handle_client_messages(self, block: bool) -> None:
        for client, message in self.front.take(block):
            self._handle_client_message(client, message)

    def _handle_client_message(self, client: bytes, message: msgspec.Struct) -> None:
        if isinstance(message, AddRequest):
            self._add_request(client, message)
        elif isinstance(message, AbortRequest):
            self._abort_request(client, message)
        elif isinstance(message, StatsRequest):
            self._reply(client, engine_stats(
                message.tag, self.scheduler, self.step_times, thermal_sensor=self.thermal_sensor,
                rejected_frames=self.front.rejected_frames,
                invalid_requests=self.invalid_requests))
        elif isinstance(message, ModelInfoRequest):
            self._reply(client, msgspec.structs.replace(self.model_info, tag=message.tag))
        elif isinstance(message, AdminBatchRequest):
            reply = admin_batch(self.config, self.scheduler, message)
            if isinstance(reply, ErrorReply):
                self._refuse(client, reply)
            else:
                self._reply(client, reply)
        elif isinstance(message, ResetPrefixCacheRequest):
            if self.scheduler.reset_prefix_cache():
                self._reply(client, Done(tag=message.tag))
            else:
                in_use = self.scheduler.kv.num_blocks - self.scheduler.kv.num_free_blocks
                self._refuse(client, ErrorReply(tag=message.tag, message=(
                    f"cannot reset the prefix cache while {in_use} KV blocks are in use; "
                    "retry when no request is running")))

    def _add_request(self, client: bytes, message: AddRequest) -> None:
        scheduler = self.scheduler
        try:
            prompt = self.tokenizer.prompt_token_ids(message)
            error = refusal(message, prompt, self.model_info, self.scheduler)
        except ValueError as refused:
            error = str(refused)
        if error is not None:
            self._refuse(client, ErrorReply(tag=message.tag, message=error,
                                            request_id=message.request_id))
            return
        request_id = message.request_id
        if request_id is None:
            while self._next_request_id in scheduler.requests:
                self._next_request_id += 1
            request_id = self._next_request_id
            self._next_request_id += 1
        self._arrivals += 1
        scheduler.add(Request(request_id, prompt, message.params, client, self._arrivals,
                              message.priority))
        if message.detokenize:
            self.tokenizer.start(request_id)
        if message.timeout_s is not None:
            heapq.heappush(self._deadlines, (time.monotonic() + message.timeout_s, request_id,
                                             self._arrivals))
        tokenized = prompt if prompt is not message.prompt_token_ids else []
        self._reply(client, RequestAccepted(tag=message.tag, request_id=request_id,
                                            prompt_token_ids=tokenized))

    def _expire_deadlines(self) -> None:
        """Requests past their timeout end now, with finish_reason "timeout"."""
        now = time.monotonic()
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id, arrival = heapq.heappop(self._deadlines)
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.arrival_seq == arrival:   # not a reused id
                self.scheduler.abort(request_id, FinishReason.TIMEOUT)
                expired.append(request)
        if expired:
            log.info("requests %s passed their deadline", [r.request_id for r in expired])
            self._stream(StepUpdate(finished=expired))

    def _abort_request(self, client: bytes, message: AbortRequest) -> None:
        request = self.scheduler.abort(message.request_id)
        if request is None:
            self._refuse(client, ErrorReply(tag=message.tag, request_id=message.request_id,
                                           message=f"unknown request id {message.request_id}: "
                                                   "it never existed or has already finished"))
            return
        self._stream(StepUpdate(finished=[request]))
        self._reply(client, AbortDone(tag=message.tag, request_id=message.request_id))

    def _stream(self, update: StepUpdate) -> None:
        """Send every client one frame holding the new tokens of all its requests."""
        by_client: dict[bytes, list[RequestDelta]] = {}
        seen: set[int] = set()
        for request in update.progressed + update.finished:
            if request.request_id in seen:
                continue
            seen.add(request.request_id)
            new_tokens = request.output_token_ids[request.num_tokens_streamed:]
            request.num_tokens_streamed = len(request.output_token_ids)
            reason = request.finish_reason.value if request.finish_reason else None
            text = self.tokenizer.text(request.request_id, new_tokens, reason is not None)
            by_client.setdefault(request.client, []).append(
                RequestDelta(request.request_id, new_tokens, reason, text))
        for client, deltas in by_client.items():
            if not self._reply(client, Outputs(deltas=deltas)):
                self._abort_client(client)

    def _abort_client(self, client: bytes) -> None:
        """A client went away: its requests stop using the workers."""
        for request in list(self.scheduler.requests.values()):
            if request.client == client:
                self.scheduler.abort(request.request_id)
                self.tokenizer.forget(request.request_id)
                log.info("aborted request %d: its client disconnected", request.request_id)

    def _refuse(self, client: bytes, error: ErrorReply) -> None:
        """A decoded request that cannot be served: the error says what to change."""
        self.invalid_requests += 1
        self._reply(client, error)

    def _reply(self, client: bytes, message: msgspec.Struct) -> bool:
        return self.front.reply(client, message)

    def _fail_everything(self, reason: str) -> None:
        if self.scheduler is None:
            return
        failed = self.scheduler.abort_all(FinishReason.ERROR)
        for request in failed:
            self.tokenizer.forget(request.request_id)
            self._reply(request.client, ErrorReply(tag=None, request_id=request.request_id,
                                                   message=f"engine failed: {reason}"))

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self.front.close()
        self.group.close()
        self.ctx.term()


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
    except WorkersFailed:
        return 1
    finally:
        server.close()
        log.info("scheduler (pid %d) stopped", os.getpid())
