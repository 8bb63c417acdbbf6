"""Scheduler + KVCacheManager with no processes: plans are driven by hand-built StepResults.

`EngineLoop` drives the scheduler exactly like scheduler_proc.server.SchedulerServer.run does
(schedule, maintain while the workers compute, update; maintain(None) and a dropped-only plan
when idle; no maintenance on a stalled step). A FakeWorker mirrors what a worker keeps (token
ids, block table, computed tokens) from the plans alone and checks every plan against it:
every context slot a request attends to must hold the KV of exactly its own token prefix (this
checks prefix-cache hits too), and a request may only write into blocks no other live request
holds. It samples a token that depends only on the request and its position -- so a request's
output must not depend on batching, preemption or cache hits.
"""
from __future__ import annotations

import random

import pytest

from protocol.messages import StepPlan, StepResult
from protocol.sampling import SamplingParams
from scheduler_proc.kv_cache_manager import KVCacheManager
from scheduler_proc.request import FinishReason, Request, RequestStatus
from scheduler_proc.scheduler import Scheduler

EOS = 2
VOCAB = 1000


def token_at(request_id: int, position: int) -> int:
    """The fake model's deterministic 'greedy' token (never EOS)."""
    return 10 + (request_id * 7919 + position * 104729) % (VOCAB - 10)


class FakeWorker:
    """Applies plans exactly like worker_proc.model_runner.ModelRunner and checks them."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
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
        scheduled = []
        for new in plan.new_requests:
            assert new.request_id not in self.state, f"request {new.request_id} sent twice"
            self.state[new.request_id] = {"tokens": list(new.token_ids),
                                          "blocks": list(new.block_ids),
                                          "computed": new.num_computed_tokens}
            scheduled.append((new.request_id, new.num_scheduled_tokens))
        assert (len(plan.cached_request_ids) == len(plan.cached_num_scheduled_tokens)
                == len(plan.cached_new_block_ids))
        for rid, n, blocks in zip(plan.cached_request_ids, plan.cached_num_scheduled_tokens,
                                  plan.cached_new_block_ids, strict=True):
            assert rid in self.state, f"cached request {rid} unknown to the worker"
            self.state[rid]["blocks"].extend(blocks)
            scheduled.append((rid, n))
        holders: dict[int, set[int]] = {}
        for rid, st in self.state.items():
            assert len(set(st["blocks"])) == len(st["blocks"]), f"request {rid} repeats a block"
            for block in st["blocks"]:
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
            for p in range(start):
                held = self.slots.get(self.slot(st["blocks"], p))
                assert held == tuple(st["tokens"][:p + 1]), (
                    f"request {rid} attends to slot of position {p} holding another prefix")
            for p in range(start, end):
                block = st["blocks"][p // self.block_size]
                assert holders[block] == {rid}, (
                    f"request {rid} writes block {block} shared with {holders[block] - {rid}}")
                self.slots[self.slot(st["blocks"], p)] = tuple(st["tokens"][:p + 1])
        for rid, n in scheduled:
            st = self.state[rid]
            st["computed"] += n
            if st["computed"] == len(st["tokens"]):
                token = sample(rid, len(st["tokens"]))
                st["tokens"].append(token)
                ids.append(rid)
                tokens.append(token)
        return StepResult(step_id=plan.step_id, request_ids=ids, sampled_token_ids=tokens,
                          forward_ms=0.0, prepare_ms=0.0)


class EngineLoop:
    """scheduler_proc.server.SchedulerServer.run without sockets."""

    def __init__(self, scheduler: Scheduler, worker: FakeWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.steps = []

    def idle(self) -> None:
        self.scheduler.maintain(None)
        plan = self.scheduler.take_dropped_only_plan()
        if plan is not None:
            self.worker.execute(plan)

    def step(self, sample=token_at):
        """One pass of the loop with work: returns (scheduled, update), update None if stalled."""
        scheduler = self.scheduler
        scheduled = scheduler.schedule()
        if not scheduled.num_scheduled:
            plan = scheduler.take_dropped_only_plan()
            if plan is not None:
                self.worker.execute(plan)
            return scheduled, None
        scheduler.maintain(scheduled)
        result = self.worker.execute(scheduled.plan, sample)
        update = scheduler.update(scheduled, result)
        self.steps.append(scheduled)
        return scheduled, update

    def run(self, sample=token_at, max_passes: int = 10_000) -> list:
        passes = stalled = 0
        while True:
            if not self.scheduler.has_work:
                self.idle()
                return self.steps
            passes += 1
            assert passes < max_passes, "scheduler made no progress"
            _, update = self.step(sample)
            stalled = stalled + 1 if update is None else 0
            assert stalled < 3, (
                "stalled: work is waiting, nothing can be scheduled and nothing will change "
                f"(running={self.scheduler.running}, waiting={list(self.scheduler.waiting)}, "
                f"free blocks={self.scheduler.kv.num_free_blocks})")


def make(num_blocks=64, block_size=16, budget=64, max_num_seqs=16, max_model_len=4096,
         eos=(EOS,), caching=False):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    scheduler = Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, eos_token_ids=list(eos))
    return scheduler, EngineLoop(scheduler, FakeWorker(block_size, num_blocks))


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
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


# ---------------------------------------------------------------------------- budget and chunks

def test_token_budget_is_respected_every_step() -> None:
    scheduler, loop = make(budget=32)
    requests = [add(scheduler, rid, prompt_len=5 + 13 * rid, max_tokens=6) for rid in range(6)]
    steps = run_to_completion(scheduler, loop)
    for s in steps:
        assert 0 < s.num_tokens <= 32
        plan_tokens = (sum(n.num_scheduled_tokens for n in s.plan.new_requests)
                       + sum(s.plan.cached_num_scheduled_tokens))
        assert plan_tokens == s.num_tokens
    assert max(s.num_tokens for s in steps) == 32, "the budget should be filled when work allows"
    for r in requests:
        assert r.finish_reason is FinishReason.LENGTH
        expected = [token_at(r.request_id, len(r.prompt_token_ids) + i) for i in range(6)]
        assert r.output_token_ids == expected
    assert_pool_full(scheduler)


def test_long_prompt_is_chunked_and_only_the_last_chunk_samples() -> None:
    scheduler, loop = make(budget=32, block_size=16)
    request = add(scheduler, 0, prompt_len=100, max_tokens=3)
    chunks = []
    for expected_computed in (32, 64, 96):
        scheduled, update = step(scheduler, loop)
        chunks.append(scheduled)
        assert request.num_computed_tokens == expected_computed
        assert request.output_token_ids == [] and not update.progressed
        assert loop.worker.plans[-1].step_id == scheduled.plan.step_id
    first = chunks[0].plan
    assert [n.request_id for n in first.new_requests] == [0]
    assert first.new_requests[0].num_scheduled_tokens == 32
    assert first.new_requests[0].num_computed_tokens == 0
    assert first.new_requests[0].token_ids == request.prompt_token_ids
    assert len(first.new_requests[0].block_ids) == 2          # blocks only for the first chunk
    assert chunks[1].plan.cached_num_scheduled_tokens == [32]
    assert [len(b) for b in chunks[1].plan.cached_new_block_ids] == [2]
    scheduled, update = step(scheduler, loop)               # last chunk: 4 tokens
    assert scheduled.plan.cached_num_scheduled_tokens == [4]
    assert [len(b) for b in scheduled.plan.cached_new_block_ids] == [1]   # 100 tokens: 7 blocks
    assert update.progressed == [request] and len(request.output_token_ids) == 1
    assert request.output_token_ids[0] == token_at(0, 100)
    run_to_completion(scheduler, loop)
    assert request.output_token_ids == [token_at(0, 100 + i) for i in range(3)]
    assert_pool_full(scheduler)


def test_decodes_are_scheduled_before_new_prefills() -> None:
    scheduler, loop = make(budget=8)
    a = add(scheduler, 0, prompt_len=8, max_tokens=5)
    step(scheduler, loop)                      # A's whole prompt
    assert len(a.output_token_ids) == 1
    b = add(scheduler, 1, prompt_len=20, max_tokens=5)
    scheduled, _ = step(scheduler, loop)
    plan = scheduled.plan
    assert plan.cached_request_ids == [0] and plan.cached_num_scheduled_tokens == [1]
    assert [n.request_id for n in plan.new_requests] == [1]
    assert plan.new_requests[0].num_scheduled_tokens == 7   # what is left of the budget
    assert scheduled.num_scheduled == {0: 1, 1: 7}
    # Next step: the decode and B's unfinished prefill, in admission order.
    scheduled, _ = step(scheduler, loop)
    assert scheduled.plan.cached_request_ids == [0, 1]
    assert scheduled.plan.cached_num_scheduled_tokens == [1, 7]
    run_to_completion(scheduler, loop)
    assert len(a.output_token_ids) == 5 and len(b.output_token_ids) == 5
    assert_pool_full(scheduler)


def test_waiting_requests_are_admitted_in_arrival_order() -> None:
    scheduler, loop = make(budget=10)
    for rid in range(4):
        add(scheduler, rid, prompt_len=4, max_tokens=2)
    scheduled, _ = step(scheduler, loop)
    assert [n.request_id for n in scheduled.plan.new_requests] == [0, 1, 2]
    assert [n.num_scheduled_tokens for n in scheduled.plan.new_requests] == [4, 4, 2]


def test_max_num_seqs_is_respected() -> None:
    scheduler, loop = make(budget=1000, max_num_seqs=2)
    requests = [add(scheduler, rid, prompt_len=4, max_tokens=3 + rid) for rid in range(4)]
    scheduled, _ = step(scheduler, loop)
    assert [n.request_id for n in scheduled.plan.new_requests] == [0, 1]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2
    while scheduler.has_work:
        assert len(scheduler.running) <= 2
        scheduled, _ = step(scheduler, loop)
        assert len(scheduled.num_scheduled) <= 2
    assert [len(r.output_token_ids) for r in requests] == [3, 4, 5, 6]
    loop.idle()
    assert_pool_full(scheduler)


# ---------------------------------------------------------------------------- preemption

def test_preemption_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens; three 8-token prompts fill the pool exactly.
    scheduler, loop = make(num_blocks=6, block_size=4, budget=100)
    a, b, c = (add(scheduler, rid, prompt_len=8, max_tokens=4) for rid in range(3))
    scheduled, _ = step(scheduler, loop)
    assert [n.request_id for n in scheduled.plan.new_requests] == [0, 1, 2]
    assert scheduler.kv.num_free_blocks == 0
    c_blocks = list(c.block_ids)

    # A's first decode needs a third block: the newest running request (C) is preempted.
    scheduled, _ = step(scheduler, loop)
    assert c.status is RequestStatus.PREEMPTED
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.num_blocks_sent == 0
    assert scheduler.waiting[0] is c and c not in scheduler.running
    assert scheduled.plan.dropped_request_ids == [2]
    assert scheduled.plan.cached_request_ids == [0, 1] and not scheduled.plan.new_requests
    assert sorted(a.block_ids[2:] + b.block_ids[2:]) == sorted(c_blocks)
    assert scheduler.counters.num_preemptions == 1 and scheduler.num_preempted == 1
    assert len(c.output_token_ids) == 1          # the token it already generated is kept
    generated_before = list(c.output_token_ids)

    # C cannot come back while A and B hold every block.
    step(scheduler, loop)
    assert c.status is RequestStatus.PREEMPTED

    while c.status is RequestStatus.PREEMPTED:
        scheduled, _ = step(scheduler, loop)
    resumed = [n for n in scheduled.plan.new_requests if n.request_id == 2]
    assert len(resumed) == 1, "C should come back as a new request once blocks are free"
    assert resumed[0].token_ids == c.prompt_token_ids + generated_before
    assert resumed[0].num_computed_tokens == 0
    assert resumed[0].num_scheduled_tokens == 9
    run_to_completion(scheduler, loop)
    for r in (a, b, c):
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == [token_at(r.request_id, 8 + i) for i in range(4)]
    assert_pool_full(scheduler)


def test_request_that_cannot_grow_preempts_itself_when_it_is_newest() -> None:
    scheduler, loop = make(num_blocks=4, block_size=4, budget=100)
    a = add(scheduler, 0, prompt_len=8, max_tokens=2)
    b = add(scheduler, 1, prompt_len=8, max_tokens=6)
    step(scheduler, loop)
    assert scheduler.kv.num_free_blocks == 0
    scheduled, _ = step(scheduler, loop)      # A needs a block: B (newest) is preempted
    assert b.status is RequestStatus.PREEMPTED and scheduled.plan.dropped_request_ids == [1]
    run_to_completion(scheduler, loop)
    assert a.output_token_ids == [token_at(0, 8 + i) for i in range(2)]
    assert b.output_token_ids == [token_at(1, 8 + i) for i in range(6)]
    assert_pool_full(scheduler)


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_preemption_lose_nothing(seed: int, caching: bool) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 16])
    max_model_len = 96
    num_blocks = max_model_len // block_size + rng.randint(0, 12)
    scheduler, loop = make(num_blocks=num_blocks, block_size=block_size,
                           budget=rng.choice([7, 16, 64]), max_num_seqs=rng.choice([3, 8]),
                           max_model_len=max_model_len, caching=caching)
    # Prompts share prefixes (a few system prompts), so the prefix cache gets hits.
    systems = [[rng.randrange(10, VOCAB) for _ in range(rng.randint(0, 40))] for _ in range(3)]
    requests = []
    for rid in range(14):
        prompt = rng.choice(systems) + [rng.randrange(10, VOCAB)
                                        for _ in range(rng.randint(1, 20))]
        requests.append(add(scheduler, rid, 0, prompt=prompt,
                            max_tokens=rng.randint(1, max_model_len - len(prompt))))
    steps = run_to_completion(scheduler, loop)
    for r in requests:
        assert r.finish_reason is FinishReason.LENGTH
        n = len(r.prompt_token_ids)
        assert r.output_token_ids == [token_at(r.request_id, n + i)
                                      for i in range(r.params.max_tokens)]
    assert scheduler.counters.num_finished == len(requests)
    assert scheduler.counters.num_generated_tokens == sum(r.params.max_tokens for r in requests)
    assert all(s.num_tokens <= scheduler.max_num_batched_tokens for s in steps)
    assert_pool_full(scheduler)
    # Every request the workers were told about is dropped, at the latest by the idle plan.
    assert loop.worker.state == {}
    if caching:
        assert scheduler.kv.counters.hits > 0, "shared prefixes should hit the cache"


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_preemption_actually_happens_under_pressure(caching: bool) -> None:
    """The workload of tests/runtime/test_llm_features.py: 6 x (56 + 40) tokens, 24 blocks."""
    scheduler, loop = make(num_blocks=24, block_size=16, budget=32, caching=caching)
    requests = [add(scheduler, rid, prompt_len=56, max_tokens=40, ignore_eos=True)
                for rid in range(6)]
    run_to_completion(scheduler, loop)
    assert scheduler.counters.num_preemptions > 0
    for r in requests:
        assert r.output_token_ids == [token_at(r.request_id, 56 + i) for i in range(40)]
    assert_pool_full(scheduler)


def test_resumed_request_reuses_its_own_cached_blocks() -> None:
    scheduler, loop = make(num_blocks=6, block_size=4, budget=100, caching=True)
    a, b, c = (add(scheduler, rid, prompt_len=8, max_tokens=4) for rid in range(3))
    step(scheduler, loop)
    step(scheduler, loop)                      # C preempted; its 2 full blocks stay cached
    assert c.status is RequestStatus.PREEMPTED
    while c.status is RequestStatus.PREEMPTED:
        scheduled, _ = step(scheduler, loop)
    (resumed,) = [n for n in scheduled.plan.new_requests if n.request_id == 2]
    # Whatever survived eviction is reused; the FakeWorker checks those slots hold C's prefix.
    assert resumed.num_computed_tokens % 4 == 0
    assert resumed.num_computed_tokens + resumed.num_scheduled_tokens == 9
    run_to_completion(scheduler, loop)
    for r in (a, b, c):
        assert r.output_token_ids == [token_at(r.request_id, 8 + i) for i in range(4)]
    assert_pool_full(scheduler)


def test_identical_prompts_share_cached_blocks() -> None:
    scheduler, loop = make(num_blocks=32, block_size=4, budget=100, caching=True)
    prompt = list(range(100, 118))                      # 18 tokens: 4 full blocks
    first = add(scheduler, 0, 0, prompt=prompt, max_tokens=2)
    run_to_completion(scheduler, loop)
    second = add(scheduler, 1, 0, prompt=prompt, max_tokens=2)
    scheduled, _ = step(scheduler, loop)
    (new,) = scheduled.plan.new_requests
    assert new.num_computed_tokens == 16 and new.num_scheduled_tokens == 2
    run_to_completion(scheduler, loop)
    assert second.output_token_ids == [token_at(1, 18), token_at(1, 19)]
    assert first.output_token_ids == [token_at(0, 18), token_at(0, 19)]
    assert_pool_full(scheduler)


# ---------------------------------------------------------------------------- stalls

@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_waiting_request_runs_after_a_finished_one_filled_the_pool(caching: bool) -> None:
    """A (100 + 20 tokens) fills all 8 blocks; B (100 tokens) waits for them. When A finishes,
    its blocks are only freed by maintain(), which the server loop runs during a step or when
    idle -- B must still get admitted, not stall forever."""
    scheduler, loop = make(num_blocks=8, block_size=16, budget=1024, max_model_len=128,
                           caching=caching)
    a = add(scheduler, 0, 100, max_tokens=20, ignore_eos=True)
    b = add(scheduler, 1, 100, max_tokens=20, ignore_eos=True)
    run_to_completion(scheduler, loop)
    assert a.output_token_ids == [token_at(0, 100 + i) for i in range(20)]
    assert b.output_token_ids == [token_at(1, 100 + i) for i in range(20)]
    assert_pool_full(scheduler)


def test_a_stalled_step_does_not_lose_dropped_request_ids() -> None:
    """Requests to forget must reach the workers even when a schedule() call computes nothing
    (this workload used to stall with request 0's blocks not yet freed)."""
    scheduler, loop = make(num_blocks=8, block_size=16, budget=1024, max_model_len=128)
    add(scheduler, 0, 100, max_tokens=20, ignore_eos=True)
    add(scheduler, 1, 100, max_tokens=20, ignore_eos=True)
    while 0 in scheduler.requests:
        step(scheduler, loop)
    assert 0 in loop.worker.state
    scheduled = scheduler.schedule()            # A's blocks are not freed yet
    plans = [scheduled.plan]
    if not scheduled.num_scheduled:             # stalled: the server sends no plan, only this
        idle_plan = scheduler.take_dropped_only_plan()
        plans = [idle_plan] if idle_plan is not None else []
    assert any(0 in p.dropped_request_ids for p in plans), (
        "request 0 finished but no plan that reaches the workers drops it")


# ---------------------------------------------------------------------------- stopping

def finish_one(scheduler, loop, request, sample):
    run_to_completion(scheduler, loop, sample=sample)
    return request


def test_stops_on_eos() -> None:
    scheduler, loop = make()
    r = add(scheduler, 0, 4, max_tokens=10)
    finish_one(scheduler, loop, r, lambda rid, pos: EOS if pos == 6 else 50)
    assert r.output_token_ids == [50, 50, EOS] and r.finish_reason is FinishReason.STOP
    assert_pool_full(scheduler)


def test_any_of_several_eos_ids_stops() -> None:
    scheduler, loop = make(eos=(2, 7))
    r = add(scheduler, 0, 4, max_tokens=10)
    finish_one(scheduler, loop, r, lambda rid, pos: 7 if pos == 5 else 50)
    assert r.output_token_ids == [50, 7] and r.finish_reason is FinishReason.STOP


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler, loop = make()
    r = add(scheduler, 0, 4, max_tokens=5, ignore_eos=True)
    finish_one(scheduler, loop, r, lambda rid, pos: EOS)
    assert r.output_token_ids == [EOS] * 5 and r.finish_reason is FinishReason.LENGTH
    assert_pool_full(scheduler)


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    scheduler, loop = make()
    r = add(scheduler, 0, 4, max_tokens=10, stop_token_ids=(77,), ignore_eos=True)
    finish_one(scheduler, loop, r, lambda rid, pos: {4: EOS, 5: 60, 6: 77}.get(pos, 50))
    assert r.output_token_ids == [EOS, 60, 77] and r.finish_reason is FinishReason.STOP


def test_max_tokens_stops_with_length() -> None:
    scheduler, loop = make()
    r = add(scheduler, 0, 4, max_tokens=1)
    scheduled, update = step(scheduler, loop)
    assert update.finished == [r] and r.finish_reason is FinishReason.LENGTH
    assert r.output_token_ids == [token_at(0, 4)]
    loop.idle()
    assert_pool_full(scheduler)


def test_context_limit_stops_with_length() -> None:
    scheduler, loop = make(max_model_len=12)
    r = add(scheduler, 0, 10, max_tokens=100)
    run_to_completion(scheduler, loop)
    assert len(r.output_token_ids) == 2 and r.finish_reason is FinishReason.LENGTH
    assert_pool_full(scheduler)


def test_finished_requests_are_dropped_on_the_workers() -> None:
    scheduler, loop = make()
    add(scheduler, 0, 4, max_tokens=1)
    add(scheduler, 1, 4, max_tokens=3)
    step(scheduler, loop)                     # request 0 finishes here
    scheduled, _ = step(scheduler, loop)
    assert scheduled.plan.dropped_request_ids == [0]
    _, update = step(scheduler, loop)         # request 1 finishes; nothing left to schedule
    assert [r.request_id for r in update.finished] == [1] and not scheduler.has_work
    plan = scheduler.take_dropped_only_plan()
    assert plan is not None and plan.dropped_request_ids == [1] and plan.step_id == -1
    loop.worker.execute(plan)
    assert loop.worker.state == {}
    assert scheduler.take_dropped_only_plan() is None
    loop.idle()
    assert_pool_full(scheduler)


# ---------------------------------------------------------------------------- abort

def test_abort_of_a_running_request_frees_its_blocks() -> None:
    scheduler, loop = make(num_blocks=16, block_size=4)
    a = add(scheduler, 0, 10, max_tokens=50)
    b = add(scheduler, 1, 6, max_tokens=50)
    step(scheduler, loop)
    step(scheduler, loop)
    assert scheduler.kv.num_free_blocks == 16 - 3 - 2
    assert scheduler.abort(0) is a
    assert a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.ABORT
    assert a.block_ids == [] and scheduler.kv.num_free_blocks == 16 - 2
    assert 0 not in scheduler.requests and a not in scheduler.running
    scheduled, _ = step(scheduler, loop)
    assert scheduled.plan.dropped_request_ids == [0]
    assert scheduled.plan.cached_request_ids == [1]
    assert scheduler.abort(0) is None, "a finished request is unknown"
    assert scheduler.abort(12345) is None
    scheduler.abort(1)
    assert b.finish_reason is FinishReason.ABORT
    plan = scheduler.take_dropped_only_plan()
    loop.worker.execute(plan)
    assert loop.worker.state == {}
    assert_pool_full(scheduler)


def test_abort_of_a_waiting_request_and_of_one_in_flight() -> None:
    scheduler, loop = make(budget=4)
    a = add(scheduler, 0, 4, max_tokens=3)
    w = add(scheduler, 1, 4, max_tokens=3)
    scheduled = scheduler.schedule()            # only A fits the budget
    assert list(scheduled.num_scheduled) == [0]
    assert scheduler.abort(1) is w and w.finish_reason is FinishReason.ABORT
    assert scheduler.abort(0) is a              # aborted while its step is running
    result = loop.worker.execute(scheduled.plan)
    update = scheduler.update(scheduled, result)
    assert not update.progressed and not update.finished
    assert a.output_token_ids == []
    assert scheduler.take_dropped_only_plan().dropped_request_ids == [0]
    assert_pool_full(scheduler)


def test_abort_of_a_preempted_request() -> None:
    scheduler, loop = make(num_blocks=4, block_size=4, budget=100)
    add(scheduler, 0, 8, max_tokens=5)
    b = add(scheduler, 1, 8, max_tokens=5)
    step(scheduler, loop)
    scheduled, _ = step(scheduler, loop)
    assert b.status is RequestStatus.PREEMPTED
    assert scheduler.abort(1) is b and b not in scheduler.waiting
    run_to_completion(scheduler, loop)
    assert_pool_full(scheduler)
    # B was already dropped when it was preempted; it is not dropped a second time.
    dropped = [rid for plan in loop.worker.plans for rid in plan.dropped_request_ids]
    assert dropped.count(1) == 1


def test_abort_all_fails_everything() -> None:
    scheduler, loop = make(budget=4)
    for rid in range(3):
        add(scheduler, rid, 4, max_tokens=3)
    step(scheduler, loop)
    failed = scheduler.abort_all(FinishReason.ERROR)
    assert sorted(r.request_id for r in failed) == [0, 1, 2]
    assert all(r.finish_reason is FinishReason.ERROR for r in failed)
    assert_pool_full(scheduler)


# ---------------------------------------------------------------------------- kv manager

def test_kv_cache_manager_allocates_only_what_fits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = Request(0, [1] * 5, SamplingParams())
    assert kv.blocks_needed(r, 5) == 2
    assert kv.allocate_slots(r, 5) and len(r.block_ids) == 2
    r.num_computed_tokens = 5
    assert kv.blocks_needed(r, 3) == 0            # 8 tokens still fit in 2 blocks
    assert kv.blocks_needed(r, 4) == 1
    big = Request(1, [1] * 20, SamplingParams())
    assert not kv.allocate_slots(big, 20)
    assert big.block_ids == [] and kv.num_free_blocks == 2, "a failed allocation changes nothing"
    kv.free(r)
    assert r.block_ids == [] and kv.num_free_blocks == 4
