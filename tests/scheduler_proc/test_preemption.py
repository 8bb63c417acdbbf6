"""Memory pressure on a fake worker: swap out/in to the CPU pool, soft reset when it is full,
the admission watermark, and random workloads that must lose nothing."""
from __future__ import annotations

import random

import pytest
from fake_engine import VOCAB, add, assert_pool_full, make, run_to_completion, step, token_at
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import AdminBatchRequest
from spmd_runtime.scheduler_proc.admin import admin_batch
from spmd_runtime.scheduler_proc.request import FinishReason, RequestStatus
from spmd_runtime.scheduler_proc.thermal import ThermalControl, ThermalPolicy


def full_pool(num_cpu_blocks: int, **kwargs):
    """6 blocks of 4 tokens; three 8-token prompts fill the pool, and A's first decode then
    needs a block: C, the newest, is preempted."""
    scheduler, loop = make(num_blocks=6, block_size=4, budget=100, num_cpu_blocks=num_cpu_blocks,
                           **kwargs)
    requests = [add(scheduler, rid, prompt_len=8, max_tokens=4) for rid in range(3)]
    step(scheduler, loop)
    assert scheduler.kv.num_free_blocks == 0
    return scheduler, loop, requests


def test_preempted_request_is_swapped_out_and_back_in_without_recompute() -> None:
    scheduler, loop, (a, b, c) = full_pool(num_cpu_blocks=8)
    c_blocks = list(c.block_ids)
    scheduled, _ = step(scheduler, loop)
    assert c.status is RequestStatus.SWAPPED and c in scheduler.swapped
    assert scheduled.plan.swap_out == [(c_blocks[0], 0), (c_blocks[1], 1)]
    assert scheduled.plan.dropped_request_ids == [2]
    assert c.num_computed_tokens == 8 and c.cpu_block_ids == [0, 1] and c.block_ids == []
    assert scheduler.cpu_pool.num_free_blocks == 6
    counters = scheduler.counters
    assert (counters.num_swaps_out, counters.num_soft_resets, counters.num_preemptions) == (1, 0, 1)

    while c.status is RequestStatus.SWAPPED:
        scheduled, _ = step(scheduler, loop)
    (resumed,) = scheduled.plan.new_requests
    assert resumed.request_id == 2
    # Only the token sampled before the swap is computed: the 8 prompt tokens' KV came back.
    assert resumed.num_computed_tokens == 8 and resumed.num_scheduled_tokens == 1
    assert scheduled.plan.swap_in == [(resumed.block_ids[0], 0), (resumed.block_ids[1], 1)]
    assert counters.num_swaps_in == 1 and scheduler.cpu_pool.num_free_blocks == 8
    run_to_completion(scheduler, loop)
    for r in (a, b, c):
        assert r.output_token_ids == [token_at(r.request_id, 8 + i) for i in range(4)]
    assert_pool_full(scheduler)


def test_full_cpu_pool_falls_back_to_soft_reset() -> None:
    scheduler, loop, (a, b, c) = full_pool(num_cpu_blocks=1)     # C needs 2 CPU blocks
    scheduled, _ = step(scheduler, loop)
    assert c.status is RequestStatus.PREEMPTED and scheduler.waiting[0] is c
    assert scheduled.plan.swap_out == [] and c.num_computed_tokens == 0
    assert scheduler.counters.num_soft_resets == 1 and scheduler.counters.num_swaps_out == 0
    assert scheduler.cpu_pool.num_free_blocks == 1
    run_to_completion(scheduler, loop)
    for r in (a, b, c):
        assert r.output_token_ids == [token_at(r.request_id, 8 + i) for i in range(4)]
    assert_pool_full(scheduler)


def test_swapped_requests_resume_before_new_ones_are_admitted() -> None:
    scheduler, loop, (a, b, c) = full_pool(num_cpu_blocks=8)
    step(scheduler, loop)
    assert c.status is RequestStatus.SWAPPED
    d = add(scheduler, 3, prompt_len=2, max_tokens=2)       # would fit in a single block
    admitted = []
    while c.status is RequestStatus.SWAPPED:
        scheduled, _ = step(scheduler, loop)
        admitted += [n.request_id for n in scheduled.plan.new_requests]
    assert admitted[0] == 2, "the swapped request comes back before the new one"
    run_to_completion(scheduler, loop)
    assert d.output_token_ids == [token_at(3, 2), token_at(3, 3)]
    assert_pool_full(scheduler)


def test_abort_of_a_swapped_request_frees_its_cpu_blocks() -> None:
    scheduler, loop, (a, b, c) = full_pool(num_cpu_blocks=8)
    step(scheduler, loop)
    assert c.status is RequestStatus.SWAPPED
    assert scheduler.abort(2) is c and c.finish_reason is FinishReason.ABORT
    assert scheduler.cpu_pool.num_free_blocks == 8 and not scheduler.swapped
    run_to_completion(scheduler, loop)
    assert_pool_full(scheduler)
    assert loop.worker.state == {}


def test_admission_keeps_the_watermark_free_while_others_run() -> None:
    # 10 blocks of 4, watermark 0.3 -> 3 spare blocks. A takes 4 blocks; B (4 more) would
    # leave only 2 free, so B waits; once nothing runs, B is admitted whatever the watermark.
    scheduler, loop = make(num_blocks=10, block_size=4, budget=100, watermark=0.3)
    a = add(scheduler, 0, prompt_len=16, max_tokens=3)
    scheduled, _ = step(scheduler, loop)
    assert [n.request_id for n in scheduled.plan.new_requests] == [0]
    b = add(scheduler, 1, prompt_len=16, max_tokens=3)
    scheduled, _ = step(scheduler, loop)
    assert not scheduled.plan.new_requests and b.status is RequestStatus.WAITING
    run_to_completion(scheduler, loop)
    assert a.output_token_ids == [token_at(0, 16 + i) for i in range(3)]
    assert b.output_token_ids == [token_at(1, 16 + i) for i in range(3)]
    assert_pool_full(scheduler)


def test_a_request_needing_the_whole_pool_is_admitted_when_alone() -> None:
    scheduler, loop = make(num_blocks=8, block_size=4, budget=100, watermark=0.5,
                           max_model_len=32)
    r = add(scheduler, 0, prompt_len=30, max_tokens=2)
    run_to_completion(scheduler, loop)
    assert r.output_token_ids == [token_at(0, 30), token_at(0, 31)]
    assert_pool_full(scheduler)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("num_cpu_blocks", [0, 6, 64], ids=["reset", "small-swap", "swap"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_under_pressure_lose_nothing(seed: int, caching: bool,
                                                      num_cpu_blocks: int, policy: str) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 16])
    max_model_len = 96
    num_blocks = max_model_len // block_size + rng.randint(0, 8)
    scheduler, loop = make(num_blocks=num_blocks, block_size=block_size,
                           budget=rng.choice([7, 16, 64]), max_num_seqs=rng.choice([4, 12]),
                           max_model_len=max_model_len, caching=caching, policy=policy,
                           num_cpu_blocks=num_cpu_blocks, watermark=rng.choice([0.0, 0.2]))
    systems = [[rng.randrange(10, VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    requests = []
    for rid in range(16):
        prompt = rng.choice(systems) + [rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 20))]
        requests.append(add(scheduler, rid, 0, prompt=prompt,
                            max_tokens=rng.randint(1, max_model_len - len(prompt))))
    steps = run_to_completion(scheduler, loop)
    for r in requests:
        assert r.finish_reason is FinishReason.LENGTH
        n = len(r.prompt_token_ids)
        assert r.output_token_ids == [token_at(r.request_id, n + i)
                                      for i in range(r.params.max_tokens)]
    assert all(s.num_tokens <= scheduler.max_num_batched_tokens for s in steps)
    counters = scheduler.counters
    assert counters.num_finished == len(requests)
    assert counters.num_generated_tokens == sum(r.params.max_tokens for r in requests)
    if caching:
        assert scheduler.kv.counters.hits > 0, "shared prefixes should hit the cache"
    assert counters.num_preemptions > 0, "the workload should preempt"
    assert counters.num_swaps_in == counters.num_swaps_out
    if num_cpu_blocks == 0:
        assert counters.num_swaps_out == 0
    assert_pool_full(scheduler)
    assert loop.worker.state == {}


def test_admin_eviction_overrules_a_policy_returning_bad_victims(caplog) -> None:
    class Careless(ThermalPolicy):
        def select_victims(self, running, n):
            return running[:1] * n      # the same request twice

    scheduler, loop = make(num_blocks=64, block_size=4, num_cpu_blocks=16,
                           thermal=ThermalControl(Careless()))
    requests = [add(scheduler, rid, prompt_len=8, max_tokens=6) for rid in range(3)]
    step(scheduler, loop)
    reply = admin_batch(EngineConfig(enable_admin=True), scheduler,
                        AdminBatchRequest(tag=1, force_evict=2))
    assert reply.evicted_request_ids == [2, 1]          # lru order instead
    assert [r.request_id for r in scheduler.running] == [0]
    assert "must return 2 distinct running requests" in caplog.text
    scheduler.max_num_seqs = 3
    run_to_completion(scheduler, loop)
    assert all(r.status is RequestStatus.FINISHED for r in requests)
