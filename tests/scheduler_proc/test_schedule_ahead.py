"""Scheduling ahead (--step-pipelining schedule_ahead, overlap or auto): the next decode step
is planned before the result of the one in flight. The fake worker checks every plan
(scheduler_proc/fake_engine.py); outputs must equal what the fake model gives one request
alone, and every block must come back."""
from __future__ import annotations

import pytest
from fake_engine import EOS, add, assert_pool_full, make, token_at
from spmd_runtime.scheduler_proc.request import FinishReason
from spmd_runtime.scheduler_proc.thermal import ProportionalThermalPolicy, ThermalControl

PROMPT_LENS = [20, 33, 46, 59, 72, 85]
MAX_TOKENS = [5, 8, 11, 14, 17, 20]
# Requests 1 and 4 sample EOS as their 4th token.
EOS_AT = {1: PROMPT_LENS[1] + 3, 4: PROMPT_LENS[4] + 3}


def sample(rid: int, position: int) -> int:
    return EOS if EOS_AT.get(rid) == position else token_at(rid, position)


def expected(rid: int, prompt_len: int, max_tokens: int) -> list[int]:
    tokens = []
    for position in range(prompt_len, prompt_len + max_tokens):
        tokens.append(sample(rid, position))
        if tokens[-1] == EOS:
            break
    return tokens


def run(ahead: bool, between=None, **options):
    scheduler, loop = make(**options)
    requests = [add(scheduler, rid, n, max_tokens=m)
                for rid, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS, strict=True))]
    loop.ahead, loop.between = ahead, between
    loop.run(sample)
    assert_pool_full(scheduler)
    return requests, loop


def appearances(loop, rid: int) -> int:
    return sum(rid in plan.cached_request_ids or any(n.request_id == rid for n in plan.new_requests)
               for plan in loop.worker.plans)


@pytest.mark.parametrize("caching", [False, True])
def test_outputs_and_blocks_are_those_of_the_step_by_step_loop(caching) -> None:
    requests, loop = run(ahead=True, num_blocks=64, block_size=16, budget=512, caching=caching)
    assert loop.ahead_steps > 10
    for request, n, m in zip(requests, PROMPT_LENS, MAX_TOKENS, strict=True):
        assert request.output_token_ids == expected(request.request_id, n, m)
    step_by_step, _ = run(ahead=False, num_blocks=64, block_size=16, budget=512, caching=caching)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in step_by_step]
    assert [r.finish_reason for r in requests] == [r.finish_reason for r in step_by_step]


def test_a_request_that_ends_by_length_is_never_planned_past_its_end() -> None:
    requests, loop = run(ahead=True, num_blocks=64, block_size=16, budget=512)
    for request, m in zip(requests, MAX_TOKENS, strict=True):
        if request.finish_reason is FinishReason.LENGTH:
            # One prefill, then a decode for each token after the first.
            assert appearances(loop, request.request_id) == m
        else:
            # Ended by EOS as its 4th token: at most one step more than that, wasted.
            assert request.finish_reason is FinishReason.STOP
            assert appearances(loop, request.request_id) in (4, 5)


def test_requests_ending_by_length_leave_the_pipeline_running() -> None:
    """Requests 0, 2, 3 and 5 end by length (at their 5th, 11th, 14th and 20th token): the
    step after each is planned ahead without them. Only the first step and the one after the
    step where 1 and 4 sampled EOS (unknown until its result) are planned from a result."""
    requests, loop = run(ahead=True, num_blocks=64, block_size=16, budget=512)
    steps = [plan.step_id for plan in loop.worker.plans if plan.step_id >= 0]
    assert [s for s in steps if s not in loop.ahead_step_ids] == [0, 5]
    assert [r.request_id for r in requests if r.finish_reason is FinishReason.LENGTH] == [0, 2, 3, 5]


@pytest.mark.parametrize("num_cpu_blocks", [0, 64])
def test_under_memory_pressure_with_preemption(num_cpu_blocks) -> None:
    """20 blocks of 8 tokens for 6 requests that need up to 14 blocks each."""
    requests, loop = run(ahead=True, num_blocks=20, block_size=8, budget=128,
                         num_cpu_blocks=num_cpu_blocks)
    scheduler = loop.scheduler
    assert scheduler.counters.num_preemptions > 0
    for request, n, m in zip(requests, PROMPT_LENS, MAX_TOKENS, strict=True):
        assert request.output_token_ids == expected(request.request_id, n, m)


def test_aborts_and_arrivals_between_steps_in_flight() -> None:
    """The server answers clients between two steps in flight: an abort of a request in the
    step being computed, and a new request, which ends the pipeline until it is admitted."""
    events = []

    def between(loop) -> None:
        scheduler = loop.scheduler
        if len(events) == 2 and 3 in scheduler.requests:
            events.append(("abort", scheduler.abort(3)))
        elif len(events) == 5:
            events.append(("add", add(scheduler, 9, 40, max_tokens=6)))
        else:
            events.append(None)

    requests, loop = run(ahead=True, between=between, num_blocks=64, block_size=16, budget=512)
    aborted = next(r for kind, r in filter(None, events) if kind == "abort")
    assert aborted.finish_reason is FinishReason.ABORT
    late = next(r for kind, r in filter(None, events) if kind == "add")
    assert late.output_token_ids == expected(9, 40, 6)
    for request, n, m in zip(requests, PROMPT_LENS, MAX_TOKENS, strict=True):
        if request is not aborted:
            assert request.output_token_ids == expected(request.request_id, n, m)


def test_near_the_thermal_target_steps_are_planned_one_at_a_time() -> None:
    """A step planned ahead is sent before the reading of the step in flight arrives; within
    the hysteresis band below the target (79-82 C here) the scheduler waits for it."""
    def trace(step_id: int) -> float:
        return 80.0 if 12 <= step_id < 24 else 60.0

    control = ThermalControl(ProportionalThermalPolicy(target_c=82.0, hysteresis_c=3.0))
    scheduler, loop = make(num_blocks=64, block_size=16, budget=512, thermal=control)
    for rid in range(4):
        add(scheduler, rid, 30, max_tokens=40)
    loop.ahead, loop.thermal_trace = True, trace
    loop.run(sample)
    assert_pool_full(scheduler)
    # Step k is planned ahead while step k - 1 runs: the last reading known is step k - 2's.
    assert all(trace(k - 2) < 79.0 for k in loop.ahead_step_ids)
    assert any(k < 12 for k in loop.ahead_step_ids) and any(k > 26 for k in loop.ahead_step_ids)
    assert not any(14 <= k <= 25 for k in loop.ahead_step_ids)
