"""Continuous batching policy: which requests run this step and with how many tokens.

FIFO: running requests first (decodes and unfinished prefill chunks, in admission order),
then waiting requests in arrival order while the token budget, max_num_seqs and free blocks
allow. When blocks run out, the most recently admitted running request is preempted and
later recomputed from its prompt plus the tokens it already generated.

With prefix caching, a request is admitted after its cached prefix: only the rest is computed.
Hashing newly full blocks and freeing finished requests happen in `maintain`, which the step
loop runs while the workers compute.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protocol.messages import NewRequestData, StepPlan, StepResult
from scheduler_proc.kv_cache_manager import KVCacheManager
from scheduler_proc.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledStep:
    """What the scheduler decided for one step, kept until the result comes back."""

    plan: StepPlan
    num_scheduled: dict[int, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled.values())


@dataclass
class StepUpdate:
    """Requests that got new tokens or finished in one step."""

    progressed: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    num_steps: int = 0
    num_finished: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: list[int]) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.counters = SchedulerCounters()
        self._dropped: list[int] = []
        self._finished_unfreed: list[Request] = []
        self._next_step_id = 0

    # ------------------------------------------------------------------ requests in and out

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.counters.num_prompt_tokens += len(request.prompt_token_ids)

    def abort(self, request_id: int) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    def abort_all(self, reason: FinishReason) -> list[Request]:
        aborted = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        for request in aborted:
            self._finish(request, reason)
        return aborted

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_preempted(self) -> int:
        return sum(1 for r in self.waiting if r.status is RequestStatus.PREEMPTED)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[int, int] = {}
        new_requests: list[NewRequestData] = []
        cached_ids: list[int] = []
        cached_tokens: list[int] = []
        cached_blocks: list[list[int]] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                num_scheduled[request.request_id] = num_new
                budget -= num_new
                cached_ids.append(request.request_id)
                cached_tokens.append(num_new)
                num_blocks = len(request.block_ids)
                if num_blocks > request.num_blocks_sent:
                    cached_blocks.append(request.block_ids[request.num_blocks_sent:])
                    request.num_blocks_sent = num_blocks
                else:
                    cached_blocks.append([])
                index += 1

        # Admitting while preempting would just evict the newcomer next step.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            hits = self.kv.get_computed_blocks(request)
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self._allocate(request, num_new, hits):
                break
            self.kv.record_admission(request, num_hit_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_requests.append(NewRequestData(
                request_id=request.request_id, token_ids=request.all_token_ids,
                block_ids=list(request.block_ids), num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_new, params=request.params))
            request.num_blocks_sent = len(request.block_ids)
            request.known_to_workers = True

        plan = StepPlan(step_id=self._next_step_id, new_requests=new_requests,
                        cached_request_ids=cached_ids, cached_num_scheduled_tokens=cached_tokens,
                        cached_new_block_ids=cached_blocks, dropped_request_ids=self._dropped)
        self._dropped = []
        self._next_step_id += 1
        return ScheduledStep(plan=plan, num_scheduled=num_scheduled)

    def take_dropped_only_plan(self) -> StepPlan | None:
        """A plan with nothing to compute, so idle workers still forget finished requests."""
        if not self._dropped:
            return None
        plan = StepPlan(step_id=-1, new_requests=[], cached_request_ids=[],
                        cached_num_scheduled_tokens=[], cached_new_block_ids=[],
                        dropped_request_ids=self._dropped)
        self._dropped = []
        return plan

    def update(self, step: ScheduledStep, result: StepResult) -> StepUpdate:
        """Apply a step result: advance computed tokens, append samples, check stop conditions."""
        self.counters.num_steps += 1
        sampled = dict(zip(result.request_ids, result.sampled_token_ids, strict=True))
        update = StepUpdate()
        for request_id, num_tokens in step.num_scheduled.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.num_computed_tokens += num_tokens
            token = sampled.get(request_id)
            if token is None:
                continue  # a prefill chunk that has not reached the end of the prompt yet
            request.output_token_ids.append(token)
            self.counters.num_generated_tokens += 1
            update.progressed.append(request)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason, free_now=False)
                update.finished.append(request)
        return update

    def maintain(self, step: ScheduledStep | None) -> None:
        """Cache bookkeeping that can wait for the workers: cache the blocks this step fills,
        then free finished requests' blocks (in eviction order)."""
        if step is not None:
            for request_id, num_tokens in step.num_scheduled.items():
                request = self.requests.get(request_id)
                if request is not None:
                    self.kv.cache_full_blocks(request, request.num_computed_tokens + num_tokens)
        self._free_finished()

    def _free_finished(self) -> None:
        for request in self._finished_unfreed:
            self.kv.free(request)
        self._finished_unfreed.clear()

    def _allocate(self, request: Request, num_new_tokens: int, hits: list = ()) -> bool:
        """Allocate; when short of blocks, first take back those of finished requests whose
        freeing was deferred to maintenance, rather than preempt or stall."""
        if self.kv.allocate_slots(request, num_new_tokens, hits):
            return True
        if not self._finished_unfreed:
            return False
        self._free_finished()
        return self.kv.allocate_slots(request, num_new_tokens, hits)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ internals

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its blocks; it resumes from prompt + generated tokens."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._forget_on_workers(request)
        self.waiting.appendleft(request)
        self.counters.num_preemptions += 1

    def _finish(self, request: Request, reason: FinishReason, free_now: bool = True) -> None:
        if free_now:
            self.kv.free(request)
        else:
            self._finished_unfreed.append(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._forget_on_workers(request)
        del self.requests[request.request_id]
        self.counters.num_finished += 1

    def _forget_on_workers(self, request: Request) -> None:
        if request.known_to_workers:
            self._dropped.append(request.request_id)
            request.known_to_workers = False
