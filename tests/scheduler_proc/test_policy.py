"""The two scheduling policies on a fake worker: which request is scheduled in which step."""
from __future__ import annotations

import random

import pytest
from fake_engine import VOCAB, add, assert_pool_full, make, run_to_completion, step, token_at


def decoding_and_prefilling(budget: int, policy: str):
    """A decodes, B is in the middle of a chunked prefill, C waits; returns the next plan."""
    scheduler, loop = make(budget=budget, block_size=4, policy=policy)
    a = add(scheduler, 0, prompt_len=4, max_tokens=10)
    step(scheduler, loop)                                # A's prompt
    b = add(scheduler, 1, prompt_len=20, max_tokens=3)
    scheduled, _ = step(scheduler, loop)                 # A decodes, B gets the rest: 7 tokens
    assert scheduled.num_scheduled == {0: 1, 1: budget - 1}
    c = add(scheduler, 2, prompt_len=4, max_tokens=3)
    return scheduler, loop, (a, b, c)


def test_fifo_runs_decodes_then_unfinished_prefills_then_waiting() -> None:
    scheduler, loop, (a, b, c) = decoding_and_prefilling(budget=8, policy="fifo")
    scheduled, _ = step(scheduler, loop)
    assert list(scheduled.num_scheduled.items()) == [(0, 1), (1, 7)]
    assert scheduled.plan.cached_request_ids == [0, 1] and not scheduled.plan.new_requests
    scheduled, _ = step(scheduler, loop)                 # B's last 6 tokens leave 1 for C
    assert list(scheduled.num_scheduled.items()) == [(0, 1), (1, 6), (2, 1)]
    run_to_completion(scheduler, loop)
    assert c.output_token_ids == [token_at(2, 4 + i) for i in range(3)]
    assert_pool_full(scheduler)


def test_prefill_first_finishes_chunked_prefills_before_decodes() -> None:
    scheduler, loop, (a, b, c) = decoding_and_prefilling(budget=8, policy="prefill_first")
    scheduled, _ = step(scheduler, loop)                 # B's chunk takes the whole budget
    assert list(scheduled.num_scheduled.items()) == [(1, 8)]
    assert len(a.output_token_ids) == 2                  # A waited this step
    scheduled, _ = step(scheduler, loop)                 # B's last 5 tokens, then A, then C
    assert list(scheduled.num_scheduled.items()) == [(1, 5), (0, 1), (2, 2)]
    assert scheduled.plan.cached_request_ids == [1, 0]
    assert [n.request_id for n in scheduled.plan.new_requests] == [2]
    run_to_completion(scheduler, loop)
    for r, prompt_len in ((a, 4), (b, 20), (c, 4)):
        assert r.output_token_ids == [token_at(r.request_id, prompt_len + i)
                                      for i in range(r.params.max_tokens)]
    assert_pool_full(scheduler)


def test_waiting_requests_are_admitted_in_arrival_order_under_both_policies() -> None:
    for policy in ("fifo", "prefill_first"):
        scheduler, loop = make(budget=10, policy=policy)
        for rid in range(4):
            add(scheduler, rid, prompt_len=4, max_tokens=2)
        scheduled, _ = step(scheduler, loop)
        assert [n.request_id for n in scheduled.plan.new_requests] == [0, 1, 2]


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("seed", range(4))
def test_every_step_follows_the_policy_order(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    scheduler, loop = make(num_blocks=40, block_size=4, budget=rng.choice([8, 16, 24]),
                           max_num_seqs=6, policy=policy, num_cpu_blocks=rng.choice([0, 12]))
    requests = [add(scheduler, rid, 0, max_tokens=rng.randint(1, 12),
                    prompt=[rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 40))])
                for rid in range(12)]
    kinds_seen = set()
    while scheduler.has_work:
        remaining = {r.request_id: r.num_tokens - r.num_computed_tokens for r in scheduler.running}
        scheduled, update = loop.step()
        if update is None:
            continue
        # Requests running before the step, in the order they were scheduled: decodes ('d',
        # one token left) and unfinished prefills ('p').
        kinds = ["d" if remaining[rid] == 1 else "p"
                 for rid in scheduled.plan.cached_request_ids if rid in remaining]
        kinds_seen.update(kinds)
        first, second = ("d", "p") if policy == "fifo" else ("p", "d")
        assert kinds == sorted(kinds, key=[first, second].index), kinds
    loop.idle()
    assert kinds_seen == {"d", "p"}, "the workload should mix decodes and chunked prefills"
    for r in requests:
        n = len(r.prompt_token_ids)
        assert r.output_token_ids == [token_at(r.request_id, n + i)
                                      for i in range(r.params.max_tokens)]
    assert_pool_full(scheduler)
