"""Harness for scheduler tests with no processes: a fake worker and the server's step loop.

`EngineLoop` drives the scheduler exactly like scheduler_proc.server.SchedulerServer.run does
(schedule, maintain while the workers compute, update; maintain(None) and a dropped-only plan
when idle; no maintenance on a stalled step). A FakeWorker mirrors what a worker keeps (token
ids, block table, computed tokens) from the plans alone and checks every plan against it:
every context slot a request attends to must hold the KV of exactly its own token prefix (this
checks prefix-cache hits too), and a request may only write into blocks no other live request
holds. Like the real worker, it copies swapped blocks out before clearing the blocks handed out
fresh and copies swapped blocks back in after that, so a swap-in restores exactly the slots
the request computed. It samples a token that depends only on the request and its position --
so a request's output must not depend on batching, preemption, swapping or cache hits.
With a sliding window, a request attends to (and holds) only the blocks its window reaches:
the entries before it may name blocks given to others since (FREED_BLOCK in a new request).
"""
from __future__ import annotations

from spmd_runtime.protocol.messages import FREED_BLOCK, StepPlan, StepResult, ThermalReading
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.request import Request
from spmd_runtime.scheduler_proc.scheduler import Scheduler

EOS = 2
VOCAB = 1000


def token_at(request_id: int, position: int) -> int:
    """The fake model's deterministic 'greedy' token (never EOS)."""
    return 10 + (request_id * 7919 + position * 104729) % (VOCAB - 10)


class FakeWorker:
    """Applies plans exactly like worker_proc.model_runner.ModelRunner and checks them."""

    def __init__(self, block_size: int, num_blocks: int, num_cpu_blocks: int = 0,
                 window: int | None = None) -> None:
        self.window = window
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_slots: dict[int, tuple[int, ...]] = {}   # the swap space, like `slots`
        self.state: dict[int, dict] = {}
        self.plans: list[StepPlan] = []
        # slot -> the token prefix whose last token's K/V the slot holds
        self.slots: dict[int, tuple[int, ...]] = {}

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan, sample=token_at) -> StepResult | None:
        self.plans.append(plan)
        for rid in plan.dropped_request_ids:
            assert rid in self.state, f"plan drops request {rid} the worker does not hold"
            del self.state[rid]
        self._copy_blocks(plan.swap_out, to_cpu=True)
        scheduled = []
        fresh = []
        for new in plan.new_requests:
            assert new.request_id not in self.state, f"request {new.request_id} sent twice"
            self.state[new.request_id] = {"tokens": list(new.token_ids),
                                          "blocks": list(new.block_ids),
                                          "computed": new.num_computed_tokens}
            scheduled.append((new.request_id, new.num_scheduled_tokens))
            fresh.extend(block for block in new.block_ids[new.num_computed_tokens // self.block_size:]
                         if block != FREED_BLOCK)
        assert (len(plan.cached_request_ids) == len(plan.cached_num_scheduled_tokens)
                == len(plan.cached_new_block_ids))
        for rid, n, blocks in zip(plan.cached_request_ids, plan.cached_num_scheduled_tokens,
                                  plan.cached_new_block_ids, strict=True):
            assert rid in self.state, f"cached request {rid} unknown to the worker"
            self.state[rid]["blocks"].extend(blocks)
            scheduled.append((rid, n))
            fresh.extend(blocks)
        for block in fresh:      # the real worker zeroes them: whatever they held is gone
            for offset in range(self.block_size):
                self.slots.pop(block * self.block_size + offset, None)
        self._copy_blocks(plan.swap_in, to_cpu=False)
        # Speculative decoding: the proposals join the tokens, as the real worker appends them.
        proposals = dict(plan.spec_token_ids)
        for rid, proposed in proposals.items():
            self.state[rid]["tokens"].extend(proposed)
        holders: dict[int, set[int]] = {}
        for rid, st in self.state.items():
            live = st["blocks"][self.first_live_block(st["computed"]):]
            assert len(set(live)) == len(live), f"request {rid} repeats a block"
            for block in live:
                assert 0 <= block < self.num_blocks
                holders.setdefault(block, set()).add(rid)
        if plan.step_id < 0:
            assert not scheduled, "a dropped-only plan computes nothing"
            return None
        ids, tokens = [], []
        for rid, n in scheduled:
            st = self.state[rid]
            start, end = st["computed"], st["computed"] + n
            assert n >= 1 and end <= len(st["tokens"]), (rid, n, start, len(st["tokens"]))
            assert len(st["blocks"]) * self.block_size >= end, "not enough blocks for the tokens"
            for p in range(self.first_attended(start), start):
                held = self.slots.get(self.slot(st["blocks"], p))
                assert held == tuple(st["tokens"][:p + 1]), (
                    f"request {rid} attends to slot of position {p} holding another prefix")
            for p in range(start, end):
                block = st["blocks"][p // self.block_size]
                assert holders[block] == {rid}, (
                    f"request {rid} writes block {block} shared with {holders[block] - {rid}}")
                self.slots[self.slot(st["blocks"], p)] = tuple(st["tokens"][:p + 1])
        verified = []
        for rid, n in scheduled:
            st = self.state[rid]
            st["computed"] += n
            if rid in proposals:
                # Greedy verification: proposals kept while they are the model's tokens, then
                # the model's own; the rejected ones are not computed (their slots are stale).
                k = len(proposals[rid])
                del st["tokens"][-k:]
                out = []
                for proposal in proposals[rid] + [None]:
                    token = sample(rid, len(st["tokens"]))
                    st["tokens"].append(token)
                    out.append(token)
                    if token != proposal:
                        break
                st["computed"] -= k + 1 - len(out)
                verified.append((rid, out))
            elif st["computed"] == len(st["tokens"]):
                token = sample(rid, len(st["tokens"]))
                st["tokens"].append(token)
                ids.append(rid)
                tokens.append(token)
        return StepResult(step_id=plan.step_id, request_ids=ids, sampled_token_ids=tokens,
                          forward_ms=0.0, prepare_ms=0.0, spec_token_ids=verified)

    def first_attended(self, position: int) -> int:
        """The first position the query at `position` attends to."""
        return max(0, position - self.window + 1) if self.window else 0

    def first_live_block(self, position: int) -> int:
        """The first block a request whose next query is at `position` still needs."""
        return self.first_attended(position) // self.block_size

    def _copy_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        for device_block, cpu_block in pairs:
            assert 0 <= device_block < self.num_blocks and 0 <= cpu_block < self.num_cpu_blocks
            for offset in range(self.block_size):
                device_slot = device_block * self.block_size + offset
                cpu_slot = cpu_block * self.block_size + offset
                source, target = ((self.slots, self.cpu_slots) if to_cpu
                                  else (self.cpu_slots, self.slots))
                key_from, key_to = (device_slot, cpu_slot) if to_cpu else (cpu_slot, device_slot)
                if key_from in source:
                    target[key_to] = source[key_from]
                else:
                    target.pop(key_to, None)


class EngineLoop:
    """scheduler_proc.server.SchedulerServer.run without sockets."""

    def __init__(self, scheduler: Scheduler, worker: FakeWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.steps = []
        # step id -> the group's temperature reported with that step's result (None: no reading)
        self.thermal_trace = None
        # Run like the server scheduling ahead (--step-pipelining, see step_ahead).
        self.ahead = False
        self.between = None
        self.ahead_steps = 0
        self.ahead_step_ids: list[int] = []

    def idle(self) -> None:
        self.scheduler.maintain(None)
        plan = self.scheduler.take_housekeeping_plan()
        if plan is not None:
            self.worker.execute(plan)

    def step(self, sample=token_at):
        """One pass of the loop with work: returns (scheduled, update), update None if stalled."""
        scheduler = self.scheduler
        scheduled = self._schedule()
        if not scheduled.num_scheduled:
            return scheduled, None
        scheduler.maintain(scheduled)
        update = scheduler.update(scheduled, self._execute(scheduled, sample))
        self.steps.append(scheduled)
        return scheduled, update

    def _schedule(self):
        """The next step; one that computes nothing is not sent, but its housekeeping is."""
        scheduled = self.scheduler.schedule()
        if not scheduled.num_scheduled:
            plan = self.scheduler.take_housekeeping_plan()
            if plan is not None:
                self.worker.execute(plan)
        return scheduled

    def _execute(self, scheduled, sample) -> StepResult:
        """The worker's result, with the thermal trace's reading for that step, if any."""
        result = self.worker.execute(scheduled.plan, sample)
        if self.thermal_trace is not None:
            temp = self.thermal_trace(scheduled.plan.step_id)
            if temp is not None:
                result.thermal = ThermalReading(max_temp_c=temp, hottest_rank=0, temps_c=[temp])
        return result

    def step_ahead(self, sample=token_at, between=None):
        """One pass of the server's loop scheduling ahead (--step-pipelining): after each step is
        sent, the next is planned before its result where scheduler.schedule_ahead allows; the
        worker runs plans in the order sent. `between(loop)` runs where the server answers
        clients while a step planned ahead is in flight (after its maintenance). Returns
        (steps run, the last update)."""
        scheduler = self.scheduler
        scheduled = self._schedule()
        if not scheduled.num_scheduled:
            return [], None
        update = None
        run = []
        while scheduled is not None:
            ahead = scheduler.schedule_ahead(scheduled)
            scheduler.maintain(scheduled)
            if run and between is not None:
                between(self)
            update = scheduler.update(scheduled, self._execute(scheduled, sample))
            self.steps.append(scheduled)
            run.append(scheduled)
            if ahead is not None:
                self.ahead_steps += 1
                self.ahead_step_ids.append(ahead.plan.step_id)
            scheduled = ahead
        return run, update

    def run(self, sample=token_at, max_passes: int = 10_000) -> list:
        passes = stalled = 0
        while True:
            if not self.scheduler.has_work:
                self.idle()
                return self.steps
            passes += 1
            assert passes < max_passes, "scheduler made no progress"
            if self.ahead:
                _, update = self.step_ahead(sample, self.between)
            else:
                _, update = self.step(sample)
            stalled = stalled + 1 if update is None else 0
            assert stalled < 3, (
                "stalled: work is waiting, nothing can be scheduled and nothing will change "
                f"(running={self.scheduler.running}, waiting={list(self.scheduler.waiting)}, "
                f"free blocks={self.scheduler.kv.num_free_blocks})")


def make(num_blocks=64, block_size=16, budget=64, max_num_seqs=16, max_model_len=4096,
         eos=(EOS,), caching=False, policy="fifo", num_cpu_blocks=0, watermark=0.0, thermal=None,
         window=None):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, sliding_window=window)
    scheduler = Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, eos_token_ids=list(eos), policy=policy,
                          num_cpu_blocks=num_cpu_blocks, admission_watermark=watermark,
                          thermal=thermal)
    return scheduler, EngineLoop(scheduler, FakeWorker(block_size, num_blocks, num_cpu_blocks,
                                                       window))


def add(scheduler: Scheduler, rid: int, prompt_len: int, prompt=None, **params) -> Request:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    if prompt is None:
        prompt = [100 + (rid * 31 + i) % 500 for i in range(prompt_len)]
    request = Request(rid, list(prompt), SamplingParams(**params), arrival_seq=rid)
    scheduler.add(request)
    return request


def step(scheduler: Scheduler, loop: EngineLoop, sample=token_at):
    scheduled, update = loop.step(sample)
    assert update is not None, "nothing could be scheduled"
    return scheduled, update


def run_to_completion(scheduler, loop, sample=token_at):
    return loop.run(sample)


def assert_pool_full(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_count == 0 for block in kv.pool.blocks)
    assert scheduler.cpu_pool.num_free_blocks == scheduler.cpu_pool.num_blocks, "leaked CPU block"
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not scheduler.swapped
