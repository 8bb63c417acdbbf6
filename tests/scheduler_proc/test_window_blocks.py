"""Blocks freed as they leave a sliding window on every layer (KVCacheManager.slide_window),
on a fake worker that checks every slot a request attends to (fake_engine: only those within
its window) and that no two live requests write one block: the blocks a request holds stay
bounded by its window, however long it runs, under chunked prefill, preemption by swap and
by recompute, and prefix caching."""
from __future__ import annotations

import random

from fake_engine import add, assert_pool_full, make, run_to_completion, step, token_at
from spmd_runtime.protocol.messages import FREED_BLOCK
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.kv_groups import HybridKVCacheManager
from spmd_runtime.scheduler_proc.request import Request


def window_bound(window: int, chunk: int, block_size: int) -> int:
    """The most blocks a step of `chunk` tokens can need: those spanning the first query's
    window through the last token (window - 1 + chunk positions, across a block edge)."""
    return -(-(window - 1 + chunk) // block_size) + 1


def held(request: Request) -> list[int]:
    return [block for block in request.block_ids if block != FREED_BLOCK]


def test_a_decoding_request_holds_only_its_window() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, sliding_window=10)
    request = Request(0, list(range(100, 105)), SamplingParams(max_tokens=500))
    assert kv.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    most = 0
    for position in range(5, 300):          # a decode per step, far past the 8-block pool
        request.output_token_ids.append(7)
        assert kv.allocate_slots(request, 1), position
        most = max(most, len(held(request)))
        assert kv.num_free_blocks == 8 - len(held(request))
        # Every block before the window of the next query is back in the pool.
        first_needed = max(0, position - 10 + 1) // 4
        assert request.block_ids[:first_needed] == [FREED_BLOCK] * first_needed
        assert FREED_BLOCK not in request.block_ids[first_needed:]
        request.num_computed_tokens += 1
    assert most == window_bound(10, 1, 4) and len(request.block_ids) == 300 // 4
    kv.free(request)
    assert kv.num_free_blocks == 8 and request.num_blocks_slid == 0


def test_a_request_back_from_the_swap_space_gets_blocks_for_its_window_only() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, sliding_window=6)
    request = Request(0, list(range(100, 141)), SamplingParams(max_tokens=4))
    request.num_computed_tokens = 40        # swapped out at 40 computed tokens: no blocks now
    assert kv.allocate_slots(request, 1)
    # The query at 40 attends to 35..40: blocks 8 (32..35) to 10 (40..43).
    assert request.block_ids[:8] == [FREED_BLOCK] * 8 and len(held(request)) == 3
    assert kv.num_free_blocks == 5


def test_long_requests_in_a_small_pool_match_and_stay_in_their_windows() -> None:
    """Prompts and outputs far longer than the pool holds (12 blocks of 4 = 48 tokens; a
    window of 9, chunks of 8): every request finishes with the tokens of its positions, holding
    at most window_bound blocks at every step, with swaps and prefix hits."""
    window, budget, block_size = 9, 8, 4
    scheduler, loop = make(num_blocks=12, block_size=block_size, budget=budget, max_num_seqs=4,
                           num_cpu_blocks=6, caching=True, window=window)
    rng = random.Random(3)
    shared = [100 + rng.randrange(500) for _ in range(24)]
    requests = [add(scheduler, rid, 0, prompt=shared + [100 + rng.randrange(500)
                                                       for _ in range(rng.randrange(1, 60))],
                    max_tokens=rng.randrange(40, 90)) for rid in range(8)]
    bound = window_bound(window, budget, block_size)
    while scheduler.has_work:
        step(scheduler, loop)
        for request in scheduler.running:
            assert len(held(request)) <= bound, request
    for request in requests:
        n = len(request.prompt_token_ids)
        assert request.output_token_ids == [token_at(request.request_id, n + i)
                                            for i in range(request.params.max_tokens)]
    # Prefix hits on the shared prompt need only the blocks its window reaches: the first
    # ones left the pool long ago (the fake worker checks the slots attended to).
    assert scheduler.counters.num_preemptions > 0, scheduler.counters
    assert scheduler.kv.counters.hits > 0, scheduler.kv.counters
    run_to_completion(scheduler, loop)
    assert_pool_full(scheduler)


def test_blocks_that_left_the_window_still_give_prefix_hits() -> None:
    """A request's blocks go back to the pool as its window passes them, hashes kept: a later
    prompt with the same prefix finds them (its own window then frees them again), and the fake
    worker checks that the slots it attends to hold its prefix."""
    scheduler, loop = make(num_blocks=16, block_size=4, budget=8, caching=True, window=6)
    prefix = [100 + i for i in range(20)]
    first = add(scheduler, 0, 0, prompt=prefix + [7, 8], max_tokens=10)
    run_to_completion(scheduler, loop)
    second = add(scheduler, 1, 0, prompt=prefix + [9], max_tokens=10)
    scheduled, _ = step(scheduler, loop)
    assert scheduler.kv.counters.hits == 20
    assert scheduled.plan.new_requests[0].num_computed_tokens == 20
    # Its hits before the window of position 20 (15..20) went straight back to the pool.
    assert second.block_ids[:3] == [FREED_BLOCK] * 3 and len(held(second)) == 3
    run_to_completion(scheduler, loop)
    for r, n in ((first, 22), (second, 21)):
        assert r.output_token_ids == [token_at(r.request_id, n + i) for i in range(10)]
    assert_pool_full(scheduler)


def test_swapped_requests_resume_under_a_window() -> None:
    """Three 8-token prompts fill 6 blocks, and the first decode needs a seventh (a window of 9
    still reaches position 0): the newest is swapped out and back in, and the fake worker
    checks that the slots it attends to came back."""
    scheduler, loop = make(num_blocks=6, block_size=4, budget=100, num_cpu_blocks=16, window=9)
    requests = [add(scheduler, rid, prompt_len=8, max_tokens=30) for rid in range(3)]
    while scheduler.counters.num_swaps_in == 0:
        step(scheduler, loop)
    run_to_completion(scheduler, loop)
    for r in requests:
        assert r.output_token_ids == [token_at(r.request_id, 8 + i) for i in range(30)]
    assert_pool_full(scheduler)


def hybrid(full_blocks: int, window_blocks: int, window: int) -> HybridKVCacheManager:
    """A model mixing full and sliding-window layers: a pool for each, blocks of 4 tokens."""
    return HybridKVCacheManager(KVCacheManager(full_blocks, 4),
                                KVCacheManager(window_blocks, 4, sliding_window=window))


def decode(kv, request: Request, steps: int) -> None:
    """`steps` decodes of one token each, as the scheduler runs them."""
    for _ in range(steps):
        request.output_token_ids.append(7)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1


def test_mixed_layers_hold_the_whole_context_and_a_window() -> None:
    """The full-attention layers' table covers every position; the windowed layers' table
    holds at most a window's blocks (6 tokens, 1 per step: 3 blocks of 4), in a pool of 5."""
    kv = hybrid(32, 5, window=6)
    request = Request(0, list(range(100, 110)), SamplingParams(max_tokens=200))
    assert kv.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    decode(kv, request, 90)
    assert len(request.block_ids) == 25 and FREED_BLOCK not in request.block_ids
    table = request.sliding
    assert len(table.block_ids) == 25 and len(held(table)) <= window_bound(6, 1, 4)
    assert kv.sliding.peak_blocks_in_use <= window_bound(6, 10, 4)
    assert kv.num_free_blocks == 32 - 25 and kv.sliding.num_free_blocks == 5 - len(held(table))
    kv.free(request)
    assert kv.full.num_free_blocks == 32 and kv.sliding.num_free_blocks == 5
    assert kv.window_pool is kv.sliding


def test_mixed_layers_fit_both_pools_or_change_nothing() -> None:
    """A request whose chunk fits the full pool but not the windowed one gets no block in
    either."""
    kv = hybrid(32, 3, window=6)
    first = Request(0, list(range(100, 108)), SamplingParams(max_tokens=8))
    assert kv.allocate_slots(first, 8)              # 2 blocks in each pool
    second = Request(1, list(range(200, 208)), SamplingParams(max_tokens=8))
    assert not kv.allocate_slots(second, 8)
    assert second.block_ids == [] and second.sliding.block_ids == []
    assert (kv.full.num_free_blocks, kv.sliding.num_free_blocks) == (30, 1)


def test_mixed_layers_hit_where_the_windowed_pool_holds_the_window() -> None:
    """A finished 41-token prompt leaves its 10 full blocks cached in the full pool; the
    windowed pool (6 blocks) gave its first ones to later blocks but holds the last ones, all a
    next token's window (6 tokens) reaches: a prompt sharing the 40 tokens hits all 10 blocks,
    its windowed table none before the window. A prompt sharing only the first block misses:
    that block left the windowed pool."""
    kv = hybrid(32, 6, window=6)
    prompt = list(range(100, 140))
    first = Request(0, prompt + [1], SamplingParams(max_tokens=4))
    for chunk in (8, 8, 8, 8, 8, 1):                # chunked prefill, caching as it goes
        assert kv.allocate_slots(first, chunk)
        first.num_computed_tokens += chunk
        kv.cache_full_blocks(first, first.num_computed_tokens)
    kv.free(first)
    second = Request(1, prompt + [2], SamplingParams(max_tokens=4))
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 10
    assert kv.allocate_slots(second, 1, hits)
    # The window of position 40 (35..40): blocks 8 and 9 hit, block 10 is new.
    assert second.sliding.block_ids[:8] == [FREED_BLOCK] * 8
    assert len(held(second.sliding)) == 3 and second.sliding.num_blocks_slid == 8
    third = Request(2, prompt[:4] + [3], SamplingParams(max_tokens=4))
    assert len(kv.full.get_computed_blocks(third)) == 1
    assert kv.get_computed_blocks(third) == []
