"""Scheduler + KVCacheManager with no processes: stop conditions, abort and block accounting,
driven through the harness in fake_engine.py."""
from __future__ import annotations

from fake_engine import (  # noqa: E402
    EOS,
    add,
    assert_pool_full,
    make,
    run_to_completion,
    step,
    token_at,
)
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.request import FinishReason, Request, RequestStatus

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
    plan = scheduler.take_housekeeping_plan()
    assert plan is not None and plan.dropped_request_ids == [1] and plan.step_id == -1
    loop.worker.execute(plan)
    assert loop.worker.state == {}
    assert scheduler.take_housekeeping_plan() is None
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
    plan = scheduler.take_housekeeping_plan()
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
    assert scheduler.take_housekeeping_plan().dropped_request_ids == [0]
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
