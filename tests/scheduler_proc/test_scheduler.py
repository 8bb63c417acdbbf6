"""Scheduler + KVCacheManager with no processes: token budget, chunked prefill, admission
order, preemption and stalls, driven through the harness in fake_engine.py."""
from __future__ import annotations

import pytest
from fake_engine import (  # noqa: E402
    add,
    assert_pool_full,
    make,
    run_to_completion,
    step,
    token_at,
)
from spmd_runtime.scheduler_proc.request import FinishReason, RequestStatus

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


def test_queue_time_runs_from_arrival_to_the_first_scheduled_step() -> None:
    scheduler, loop = make(budget=1000, max_num_seqs=1)
    first, second = (add(scheduler, rid, prompt_len=4, max_tokens=3) for rid in range(2))
    step(scheduler, loop)
    assert first.queue_time_s is not None and first.queue_time_s >= 0
    assert second.queue_time_s is None, "still waiting"
    while second.status is not RequestStatus.RUNNING:
        step(scheduler, loop)
    # It waited for the first to finish: three steps more.
    assert second.queue_time_s >= first.queue_time_s
    measured = second.queue_time_s
    run_to_completion(scheduler, loop)
    assert second.queue_time_s == measured


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
        idle_plan = scheduler.take_housekeeping_plan()
        plans = [idle_plan] if idle_plan is not None else []
    assert any(0 in p.dropped_request_ids for p in plans), (
        "request 0 finished but no plan that reaches the workers drops it")
