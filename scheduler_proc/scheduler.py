"""Continuous batching: which requests run this step, with how many tokens, and what happens
when the KV cache runs out.

Each step, running requests take the token budget first, in the order of the scheduling
policy (scheduler_proc.policy); then swapped-out requests are brought back; then waiting
requests are admitted in arrival order while the budget, max_num_seqs and free blocks allow.
A request is admitted (or swapped in) only if its blocks, after prefix-cache hits, fit with a
watermark of spare blocks left, unless nothing else runs.

When a running request cannot get its next block, the most recently admitted running request
is preempted: its computed KV blocks are offloaded to the CPU swap space if there is room
(swap, resumed later without recomputing anything), else it is soft reset (blocks freed, and
it is recomputed later from prompt + generated tokens, prefix caching recovering what it can).
Swapped requests resume before any new request is admitted, and preempted ones go to the head
of the waiting queue, so none starves. Block copies travel in the plan.

Thermal control (scheduler_proc.thermal) caps the running batch from the hottest device's
temperature: before each step, running requests over the cap leave through the same preemption
(swap or soft reset), and swapped or waiting requests come back only under the cap.

Hashing newly full blocks and freeing finished requests happen in `maintain`, which the step
loop runs while the workers compute. Elsewhere: encoding plans and what the workers hold
(plan_builder), swap-out, soft reset and victim checks (preemption), planning the next step
before a result (schedule_ahead), speculative decoding's proposals (speculation).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from spmd_runtime.protocol.buckets import PhaseBuckets
from spmd_runtime.protocol.messages import StepPlan, StepResult
from spmd_runtime.protocol.step_shape import DECODE, PROMPT, Phase
from spmd_runtime.scheduler_proc.bucket_planner import BucketPlanner
from spmd_runtime.scheduler_proc.cpu_block_pool import CpuBlockPool
from spmd_runtime.scheduler_proc.finishing import FinishRules
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.plan_builder import ScheduledStep, StepDraft
from spmd_runtime.scheduler_proc.policy import Policy, running_order
from spmd_runtime.scheduler_proc.preemption import (
    allocate_or_preempt,
    checked_victims,
    preempt,
    restore_swapped,
)
from spmd_runtime.scheduler_proc.request import FinishReason, Request, RequestStatus
from spmd_runtime.scheduler_proc.schedule_ahead import plan_ahead
from spmd_runtime.scheduler_proc.scheduler_state import SchedulerState
from spmd_runtime.scheduler_proc.speculation import Speculator
from spmd_runtime.scheduler_proc.structured_output import ConstrainedRequests
from spmd_runtime.scheduler_proc.thermal import ProportionalThermalPolicy, ThermalControl

log = logging.getLogger("spmd.scheduler")


@dataclass
class StepUpdate:
    """Requests that got new tokens or finished in one step."""

    progressed: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class Scheduler(SchedulerState):
    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: list[int], policy: Policy = "fifo",
                 num_cpu_blocks: int = 0, admission_watermark: float = 0.0,
                 buckets: dict[Phase, PhaseBuckets] | None = None,
                 thermal: ThermalControl | None = None,
                 speculator: Speculator | None = None) -> None:
        super().__init__(kv, max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, max_model_len=max_model_len, policy=policy,
                         planner=BucketPlanner(buckets, policy) if buckets else None,
                         thermal=thermal or ThermalControl(ProportionalThermalPolicy()),
                         num_cpu_blocks=num_cpu_blocks)
        # The most requests allowed to run in the step being planned: max_num_seqs, or less
        # while the thermal policy throttles.
        self.running_cap = max_num_seqs
        # Every way a request ends is decided there (stop tokens, length, text, deadline).
        self.finish_rules = FinishRules(eos_token_ids, max_model_len)
        self.admission_watermark = admission_watermark
        self.watermark_blocks = math.floor(admission_watermark * kv.num_blocks)
        # Matchers of the requests with a structured output (configured by the server).
        self.constrained = ConstrainedRequests()
        # Speculative decoding's proposals (None: off). With buckets, a request verifying k
        # proposals takes k + 1 rows of a decode step's bucket (speculation).
        self.speculator = speculator

    # ------------------------------------------------------------------ requests in and out

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.counters.num_prompt_tokens += len(request.prompt_token_ids)

    def abort(self, request_id: int, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason)
        return request

    def abort_all(self, reason: FinishReason) -> list[Request]:
        aborted = list(self.running) + list(self.swapped) + list(self.waiting)
        self.running.clear()
        self.swapped.clear()
        self.waiting.clear()
        for request in aborted:
            self._finish(request, reason)
        return aborted

    def get(self, request_id: int) -> Request | None:
        """The unfinished request with this id, if any."""
        return self.requests.get(request_id)

    def requests_of(self, client: bytes) -> list[Request]:
        """The unfinished requests a client sent."""
        return [request for request in self.requests.values() if request.client == client]

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of the CPU swap space."""
        return self.cpu_pool.num_blocks

    @property
    def num_kv_blocks_in_use(self) -> int:
        return self.kv.num_blocks - self.kv.num_free_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    @property
    def num_preempted(self) -> int:
        """Soft-reset requests waiting to be recomputed."""
        return sum(1 for r in self.waiting if r.status is RequestStatus.PREEMPTED)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> ScheduledStep:
        self._apply_running_cap()
        if self.planner is None:
            return self._with_masks(self.plans.finalize(self._schedule_pass(None)))
        phase = self.planner.pick_phase(self.running, self.swapped[0] if self.swapped else None,
                                        bool(self.waiting))
        draft = self._schedule_pass(phase)
        if not draft.num_scheduled:
            # Nothing of that phase could run (its only candidate may even have had to give
            # its blocks up): the other phase's requests must not wait on it.
            draft = self._schedule_pass(phase.other, draft.preempted)
        return self._with_masks(self.plans.finalize(draft))

    def _with_masks(self, step: ScheduledStep) -> ScheduledStep:
        """The token masks of the constrained requests that sample at the end of `step`, and of
        those verifying proposals (a mask per row)."""
        if self.constrained:
            sampling = (rid for rid, n in step.num_scheduled.items()
                        if self.requests[rid].samples_after(n))
            step.plan.token_masks = self.constrained.masks(sampling) + [
                (rid, masks) for rid, proposals in step.plan.spec_token_ids
                if (masks := self.constrained.run_masks(rid, proposals)) is not None]
        return step

    def schedule_ahead(self, step: ScheduledStep) -> ScheduledStep | None:
        """The step after `step`, planned before its result where that can be done blind
        (scheduler_proc.schedule_ahead); None where it cannot."""
        return plan_ahead(self, step)

    def _schedule_pass(self, phase: Phase | None, preempted: bool = False) -> StepDraft:
        """Fill a step; with buckets, only with requests of `phase` and only while the batch
        still fits a bucket."""
        draft = StepDraft(phase=phase, preempted=preempted)
        budget = self.max_num_batched_tokens
        speculating = self.speculator is not None and self.speculator.active(len(self.running))
        for request in running_order(self.running, self.policy):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new, longest = self._tokens_to_schedule(request, budget, draft)
            if speculating and num_new == 1 and self.speculator.speculate(self, request, budget,
                                                                          draft):
                budget -= draft.num_scheduled[request.request_id]
                continue
            # The usual case first, in one call: room without preempting anyone.
            if num_new and (self.kv.allocate_slots(request, num_new)
                            or allocate_or_preempt(self, request, num_new, draft)):
                draft.longest = longest
                self.plans.add_running(request, num_new, draft)
                budget -= num_new

        # Bringing requests in while preempting would only evict them again next step.
        if not draft.preempted:
            while (self.swapped and budget > 0 and len(self.running) < self.running_cap
                   and self._swap_in(self.swapped[0], budget, draft)):
                budget -= draft.num_scheduled[self.swapped.popleft().request_id]
            while (not self.swapped and self.waiting and budget > 0 and phase is not DECODE
                   and len(self.running) < self.running_cap
                   and self._admit(self.waiting[0], budget, draft)):
                budget -= draft.num_scheduled[self.waiting.popleft().request_id]
        return draft

    def _apply_running_cap(self) -> None:
        """Ask the thermal control for this step's cap; running requests over it leave."""
        demand = len(self.running) + len(self.swapped) + len(self.waiting)
        self.running_cap = self.thermal.running_cap(self.running_cap, self.max_num_seqs, demand)
        excess = len(self.running) - self.running_cap
        if excess <= 0:
            return
        victims = checked_victims(self.thermal.policy, self.running, excess)
        self.evict(victims)
        self.thermal.record_evictions(self.plans.next_step_id, self.running_cap,
                                      len(self.running), [r.request_id for r in victims])

    def evict(self, victims: list[Request]) -> None:
        """Take running requests off the batch through preemption (swap if the CPU pool has
        room, else soft reset); they come back when the cap allows."""
        for request in victims:
            preempt(self, request)

    def _tokens_to_schedule(self, request: Request, budget: int, draft: StepDraft,
                            num_hit_tokens: int = 0, admitting: bool = False) -> tuple[int, int]:
        """Tokens the request computes in this step, 0 if it does not belong in it (another
        phase, or no bucket would fit it alongside the requests already in), and the step's
        length dimension with it (bucket_planner). A newcomer always prefills."""
        num_left = request.num_tokens - request.num_computed_tokens - num_hit_tokens
        planner = self.planner
        if planner is None or draft.phase is None:     # no buckets, or a step without them
            return min(num_left, budget), 0
        # Phase.of(num_left), inlined: this runs for every request of every step.
        phase = PROMPT if admitting or num_left != 1 else DECODE
        if phase is not draft.phase:
            return 0, draft.longest
        batch = phase.batch_size(len(draft.num_scheduled), self.max_num_batched_tokens - budget)
        return planner.take(phase, request, min(num_left, budget), batch + 1, draft.longest)

    def _admission_reserve(self) -> int:
        """Spare blocks a newcomer must leave; none when nothing runs, so a request that fits
        the pool alone always gets in."""
        return self.watermark_blocks if self.running else 0

    def _admit(self, request: Request, budget: int, draft: StepDraft) -> bool:
        hits = self.kv.get_computed_blocks(request)
        num_hit_tokens = len(hits) * self.kv.block_size
        num_new, longest = self._tokens_to_schedule(request, budget, draft, num_hit_tokens,
                                                    admitting=True)
        if not num_new or not self.allocate(request, num_new, hits, self._admission_reserve()):
            return False
        request.num_computed_tokens += num_hit_tokens
        self.kv.record_admission(request, num_hit_tokens)
        self._start(request, num_new, draft, longest)
        return True

    def _swap_in(self, request: Request, budget: int, draft: StepDraft) -> bool:
        """Fresh device blocks for a swapped request; its computed blocks are copied back into
        the first ones before the forward pass."""
        num_new, longest = self._tokens_to_schedule(request, budget, draft)
        if not num_new or not self.allocate(request, num_new, reserve=self._admission_reserve()):
            return False
        restore_swapped(self, request, draft)
        self._start(request, num_new, draft, longest)
        return True

    def _start(self, request: Request, num_new: int, draft: StepDraft, longest: int) -> None:
        """A request joins the running batch; the workers get all they need to know about it."""
        request.status = RequestStatus.RUNNING
        if request.queue_time_s is None:
            request.queue_time_s = time.monotonic() - request.arrival_time
        self.running.append(request)
        draft.longest = longest
        self.plans.add_new(request, num_new, draft)

    def take_housekeeping_plan(self) -> StepPlan | None:
        """A plan that computes nothing, so idle or stalled workers still forget finished
        requests and offload preempted ones."""
        return self.plans.housekeeping_plan()

    def update(self, step: ScheduledStep, result: StepResult) -> StepUpdate:
        """Apply a step result: advance computed tokens, append samples, check stop conditions."""
        self.counters.num_steps += 1
        sampled = dict(zip(result.request_ids, result.sampled_token_ids, strict=True))
        verified = dict(result.spec_token_ids)
        proposed = {rid: len(tokens) for rid, tokens in step.plan.spec_token_ids}
        proposed.update(step.plan.draft_lengths)
        drafted = dict(result.draft_proposals)
        logprobs = {record.request_id: record for record in result.logprobs}
        update = StepUpdate()
        if result.thermal is not None:
            self.thermal.observe(result.thermal, self.plans.next_step_id, self.running_cap,
                                 len(self.running))
        for request_id, num_tokens in step.num_scheduled.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.drafted = drafted.get(request_id, [])   # a step on makes older ones stale
            tokens = verified.get(request_id)
            if tokens is not None:
                # Its last token and the accepted proposals have their KV; the rest is void.
                num_tokens = len(tokens)
                self.speculator.record(request, proposed[request_id], len(tokens) - 1)
            request.num_computed_tokens += num_tokens
            if logprobs:
                request.note_logprobs(logprobs.get(request_id))
            if tokens is None:
                token = sampled.get(request_id)
                if token is None:
                    continue  # a prefill chunk that has not reached the end of the prompt yet
                tokens = (token,)
            update.progressed.append(request)
            self._take_tokens(request, tokens, update)
        return update

    def _take_tokens(self, request: Request, tokens, update: StepUpdate) -> None:
        """Append a request's new tokens in order until one ends it (the rest are dropped)."""
        for token in tokens:
            request.output_token_ids.append(token)
            self.counters.num_generated_tokens += 1
            reason = self.finish_rules.after_token(request, token)
            if self.constrained.accept(request.request_id, token) and reason is None:
                reason = FinishReason.STOP      # its structured output is complete
            if reason is not None:
                # A verified run's records past the token that ended it go with its tokens.
                del request.output_logprobs[len(request.output_token_ids):]
                self.running.remove(request)
                self._finish(request, reason, free_now=False)
                update.finished.append(request)
                return

    def maintain(self, step: ScheduledStep | None) -> None:
        """Cache bookkeeping that can wait for the workers: cache the blocks this step fills,
        then free finished requests' blocks (in eviction order)."""
        if step is not None and self.kv.enable_caching:
            block_size = self.kv.block_size
            for request_id, num_tokens in step.num_scheduled.items():
                request = self.requests.get(request_id)
                if request is None:
                    continue
                # Proposals being verified are no tokens of the request's yet: up to its last.
                computed = min(request.num_computed_tokens + num_tokens, request.num_tokens)
                # Most steps fill no block of most requests: skip those without the call.
                if computed // block_size > request.num_cached_blocks:
                    self.kv.cache_full_blocks(request, computed)
        self._free_finished()

    def restart(self, kv: KVCacheManager, num_cpu_blocks: int) -> list[Request]:
        """The worker group was replaced: every KV block, on the devices and in the CPU swap
        space, is gone, and so is the step in flight. Running and swapped requests are soft
        reset (recomputed from prompt + the tokens they already produced, which were streamed)
        and go first in the queue, in admission order. Returns them."""
        in_flight = sorted(self.running + list(self.swapped), key=lambda r: r.arrival_seq)
        for request in in_flight:
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.block_ids, request.cpu_block_ids = [], []
            request.num_cached_blocks = request.num_blocks_slid = 0
            self.plans.forget(request)
            request.sliding = None
        self.running.clear()
        self.swapped.clear()
        self.waiting.extendleft(reversed(in_flight))
        self.kv = kv
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.watermark_blocks = math.floor(self.admission_watermark * kv.num_blocks)
        self.plans.clear()
        self._finished_unfreed = []
        self.counters.num_worker_restarts += 1
        return in_flight

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ internals

    def _finish(self, request: Request, reason: FinishReason, free_now: bool = True) -> None:
        if request.cpu_block_ids:
            self.cpu_pool.free(request.cpu_block_ids)
            request.cpu_block_ids = []
        if free_now:
            self.kv.free(request)
        else:
            self._finished_unfreed.append(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.constrained.forget(request.request_id)
        self.plans.forget(request)
        del self.requests[request.request_id]
        self.counters.num_finished += 1
