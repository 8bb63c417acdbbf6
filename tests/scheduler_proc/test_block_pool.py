"""Prefix caching without processes: the block pool (free queue = eviction order, hash -> blocks),
block hashing, the KVCacheManager API and the Scheduler's use of it.

Tests are written from the intended behaviour:
* a block's hash covers its parent's hash, its tokens and (first block only) the cache salt;
* only completely filled blocks are hashed and cached;
* hits stop at the first miss and never cover a prompt's last token;
* freed blocks join the tail of the free queue, a request's blocks last-first; allocation pops
  the head, and a popped block loses its hash (eviction);
* a request that does not fit changes nothing.
"""
from __future__ import annotations

import random

import pytest
from spmd_runtime.protocol.messages import StepResult
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.scheduler_proc.block_hash import hash_block
from spmd_runtime.scheduler_proc.block_pool import BlockPool, KVBlock
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.request import Request, RequestStatus
from spmd_runtime.scheduler_proc.scheduler import Scheduler

BS = 4       # small blocks keep the token arithmetic readable
EOS = 2


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(count)]


def make_request(rid: int, token_ids: list[int], salt: str | None = None,
                 max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, cache_salt=salt)
    return Request(rid, list(token_ids), params, arrival_seq=rid)


def admit(kv: KVCacheManager, request: Request, cache: bool = True) -> list[KVBlock]:
    """What the scheduler does for a new request whose whole prompt fits: look up hits,
    allocate the rest, and (as maintain does after the step) cache the blocks it fills."""
    hits = kv.get_computed_blocks(request)
    num_new = request.num_tokens - len(hits) * kv.block_size
    assert kv.allocate_slots(request, num_new, hits)
    request.num_computed_tokens += len(hits) * kv.block_size
    if cache:
        kv.cache_full_blocks(request, request.num_computed_tokens + num_new)
    request.num_computed_tokens += num_new
    return hits


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def refs(kv: KVCacheManager, block_ids) -> list[int]:
    return [kv.pool.blocks[b].ref_count for b in block_ids]


def assert_pool_consistent(pool: BlockPool) -> None:
    """Free queue == the blocks with ref 0, no duplicates; cached map == blocks with a hash."""
    queued = free_ids(pool)
    assert len(queued) == len(set(queued)) == len(pool.free_queue) == pool.num_free_blocks
    assert sorted(queued) == sorted(b.block_id for b in pool.blocks if b.ref_count == 0)
    assert all(b.ref_count >= 0 for b in pool.blocks)
    by_hash = {(h, bid) for h, blocks in pool.cached.items() for bid in blocks}
    assert by_hash == {(b.block_hash, b.block_id) for b in pool.blocks if b.block_hash is not None}
    assert all(blocks for blocks in pool.cached.values()), "empty hash entry left behind"


# ---------------------------------------------------------------------------- hits

def test_second_request_hits_the_three_shared_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = tokens(10, 3 * BS)
    a = make_request(0, prefix + tokens(11, 2))
    assert admit(kv, a) == []
    assert len(a.block_ids) == 4 and a.num_cached_blocks == 3
    b = make_request(1, prefix + tokens(12, 3))
    hits = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == a.block_ids[:3]
    assert kv.allocate_slots(b, b.num_tokens - 3 * BS, hits)
    b.num_computed_tokens += len(hits) * BS          # the scheduler's part of admission
    assert b.block_ids[:3] == a.block_ids[:3]
    assert b.num_computed_tokens == 3 * BS
    assert refs(kv, a.block_ids[:3]) == [2, 2, 2]
    assert refs(kv, a.block_ids[3:]) == [1]          # A's partial block is A's alone
    assert len(b.block_ids) == 4                     # 15 tokens: 3 hits + 1 new block
    assert b.block_ids[3] not in a.block_ids
    assert refs(kv, b.block_ids[3:]) == [1]
    assert kv.num_free_blocks == 16 - 5
    assert_pool_consistent(kv.pool)


def test_hits_stop_at_the_first_miss() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request(0, tokens(20, 4 * BS))
    admit(kv, a)
    ids = list(a.prompt_token_ids) + [7]
    ids[BS + 1] += 1                                  # block 1 differs: blocks 2 and 3 are misses
    b = make_request(1, ids)
    assert [blk.block_id for blk in kv.get_computed_blocks(b)] == a.block_ids[:1]

    # A deeper block may outlive its evicted parent; a lookup must still stop at the parent.
    pool = kv.pool
    c0, c1, c2, c3 = (pool.blocks[i] for i in a.block_ids)
    kv.free(a)
    pool.allocate(len(pool.free_queue) - 4)          # the never-used blocks go first
    assert list(pool.free_queue) == [c3, c2, c1, c0]
    pool.touch([c3, c2])
    assert pool.allocate(1) == [c1] and c1.block_hash is None
    pool.free([c2, c3])
    assert c2.block_hash is not None and c3.block_hash is not None
    again = make_request(2, list(a.prompt_token_ids) + [7])
    assert kv.get_computed_blocks(again) == [c0]


def test_hits_never_cover_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = tokens(30, 2 * BS)
    admit(kv, make_request(0, prompt))
    assert kv.pool.num_cached_blocks == 2
    free_before, refs_before = free_ids(kv.pool), [b.ref_count for b in kv.pool.blocks]

    same = make_request(1, prompt)                    # exactly two full blocks: one hit
    assert len(kv.get_computed_blocks(same)) == 1
    longer = make_request(2, prompt + [5])            # one more token: both blocks hit
    assert len(kv.get_computed_blocks(longer)) == 2
    first_block_only = make_request(3, prompt[:BS])   # exactly one block: no hit at all
    assert kv.get_computed_blocks(first_block_only) == []
    # get_computed_blocks changes nothing.
    assert free_ids(kv.pool) == free_before
    assert [b.ref_count for b in kv.pool.blocks] == refs_before

    hits = kv.get_computed_blocks(same)
    assert kv.allocate_slots(same, 2 * BS - BS, hits)
    same.num_computed_tokens += len(hits) * BS       # the scheduler's part of admission
    assert same.num_computed_tokens == BS and len(same.block_ids) == 2


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    prompt = tokens(40, 3 * BS + 1)
    a = make_request(0, prompt)
    admit(kv, a)
    assert kv.pool.cached == {} and all(b.block_hash is None for b in kv.pool.blocks)
    b = make_request(1, prompt)
    assert kv.get_computed_blocks(b) == []
    kv.free(a)
    assert kv.get_computed_blocks(b) == []
    kv.record_admission(b, 0)
    assert kv.counters.queries == 0 and kv.counters.hits == 0 and kv.counters.hit_rate == 0.0


def test_salted_request_hits_only_with_the_same_salt() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = tokens(50, 3 * BS)
    a = make_request(0, prompt, salt="a")
    admit(kv, a)
    a_ids = list(a.block_ids)
    kv.free(a)
    assert kv.get_computed_blocks(make_request(1, prompt, salt="b")) == []
    assert kv.get_computed_blocks(make_request(2, prompt, salt=None)) == []
    same_salt = kv.get_computed_blocks(make_request(3, prompt, salt="a"))
    assert [blk.block_id for blk in same_salt] == a_ids[:2]    # 12 tokens: 2 hits

    # And the other way round: an unsalted prefix is invisible to a salted request.
    plain = make_request(4, tokens(51, 3 * BS))
    admit(kv, plain)
    assert kv.get_computed_blocks(make_request(5, plain.prompt_token_ids, salt="a")) == []
    assert len(kv.get_computed_blocks(make_request(6, plain.prompt_token_ids))) == 2


# ---------------------------------------------------------------------------- allocation

def test_hit_block_at_the_free_queue_head_is_not_handed_out_again() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request(0, tokens(60, BS))               # one full block: block 0
    x = make_request(1, tokens(61, 2 * BS))           # blocks 1, 2
    admit(kv, a)
    admit(kv, x)
    assert a.block_ids == [0] and x.block_ids == [1, 2]
    kv.free(a)
    kv.free(x)
    assert free_ids(kv.pool) == [0, 2, 1]             # A's cached block is at the head

    b = make_request(2, a.prompt_token_ids + tokens(62, 6))   # 10 tokens: 3 blocks
    hits = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0]
    assert kv.allocate_slots(b, b.num_tokens - BS, hits)
    assert b.block_ids[0] == 0
    assert len(b.block_ids) == 3 and len(set(b.block_ids)) == 3
    assert 0 not in b.block_ids[1:], "the hit block was also handed out as a new block"
    assert refs(kv, [0, 1, 2]) == [1, 1, 1]
    assert kv.pool.lookup(hits[0].block_hash) is kv.pool.blocks[0]   # the hit kept its hash
    assert kv.pool.num_cached_blocks == 1                             # X's blocks were evicted
    assert_pool_consistent(kv.pool)


def test_request_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    prefix = tokens(70, 3 * BS)
    a = make_request(0, prefix)
    admit(kv, a)                                      # blocks 0-2, all cached, A still running

    def snapshot():
        return ([(b.ref_count, b.block_hash) for b in kv.pool.blocks], free_ids(kv.pool),
                {h: list(blocks) for h, blocks in kv.pool.cached.items()})

    # Hits on blocks in use: needs 8 blocks, 3 of them hits, 5 new > 2 free.
    b = make_request(1, prefix + tokens(71, 5 * BS))
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 3
    before = snapshot()
    assert kv.allocate_slots(b, b.num_tokens - 3 * BS, hits) is False
    assert snapshot() == before
    assert refs(kv, a.block_ids) == [1, 1, 1]
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_cached_blocks == 0

    # Hits sitting in the free queue count against the free blocks: 3 hits + 3 new > 5.
    a_ids = list(a.block_ids)
    kv.free(a)
    c = make_request(2, prefix + tokens(72, 3 * BS))
    hits = kv.get_computed_blocks(c)
    assert len(hits) == 3 and all(blk.ref_count == 0 for blk in hits)
    before = snapshot()
    assert len(kv.pool.free_queue) == 5
    assert kv.allocate_slots(c, c.num_tokens - 3 * BS, hits) is False
    assert snapshot() == before
    assert refs(kv, a_ids) == [0, 0, 0] and len(kv.pool.free_queue) == 5
    assert c.block_ids == [] and c.num_computed_tokens == 0

    # One block less, and it fits exactly.
    d = make_request(3, prefix + tokens(73, 2 * BS))
    hits = kv.get_computed_blocks(d)
    assert kv.allocate_slots(d, d.num_tokens - 3 * BS, hits) is True
    assert kv.num_free_blocks == 0 and d.block_ids[:3] == a_ids
    assert_pool_consistent(kv.pool)


def test_decode_tokens_fill_a_partial_block_before_it_is_hashed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request(0, tokens(80, BS + 2))           # one full block + 2 tokens
    admit(kv, r)
    full, partial = (kv.pool.blocks[b] for b in r.block_ids)
    assert full.block_hash is not None
    assert partial.block_hash is None and r.num_cached_blocks == 1
    assert kv.pool.num_cached_blocks == 1

    for token in (501, 502):                          # decode: the partial block fills up
        r.output_token_ids.append(token)
        assert kv.allocate_slots(r, 1)
        assert len(r.block_ids) == 2
        kv.cache_full_blocks(r, r.num_computed_tokens + 1)
        r.num_computed_tokens += 1
        if r.num_tokens < 2 * BS:
            assert partial.block_hash is None, "a partially filled block was hashed"
            assert kv.pool.num_cached_blocks == 1
    assert r.num_tokens == 2 * BS
    assert partial.block_hash == hash_block(full.block_hash, r.all_token_ids[BS:2 * BS])
    assert r.num_cached_blocks == 2 and kv.pool.num_cached_blocks == 2
    assert kv.pool.lookup(partial.block_hash) is partial

    # The next token opens a third block, which stays unhashed.
    r.output_token_ids.append(503)
    assert kv.allocate_slots(r, 1)
    kv.cache_full_blocks(r, r.num_computed_tokens + 1)
    assert len(r.block_ids) == 3 and kv.pool.blocks[r.block_ids[2]].block_hash is None

    # A new request with the same 8 tokens plus one more hits both blocks, decode one included.
    other = make_request(1, r.all_token_ids[:2 * BS] + [9])
    assert [b.block_id for b in kv.get_computed_blocks(other)] == r.block_ids[:2]


# ---------------------------------------------------------------------------- free and evict

def test_free_order_is_last_block_first_and_allocation_evicts_in_that_order() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request(0, tokens(90, 3 * BS))
    b = make_request(1, tokens(91, 3 * BS))
    admit(kv, a)
    admit(kv, b)
    assert kv.num_free_blocks == 0 and kv.pool.num_cached_blocks == 6
    kv.free(a)
    kv.free(b)
    expected = [2, 1, 0, 5, 4, 3]                  # A last-first, then B last-first
    assert free_ids(kv.pool) == expected
    assert kv.pool.num_cached_blocks == 6          # freed blocks keep their hashes

    for position, block_id in enumerate(expected):
        block_hash = kv.pool.blocks[block_id].block_hash
        assert block_hash is not None and kv.pool.lookup(block_hash) is kv.pool.blocks[block_id]
        (popped,) = kv.pool.allocate(1)
        assert popped.block_id == block_id, f"eviction #{position} took the wrong block"
        assert popped.block_hash is None and popped.ref_count == 1
        assert block_hash not in kv.pool.cached and kv.pool.lookup(block_hash) is None
        assert kv.pool.num_cached_blocks == 5 - position
        for later in expected[position + 1:]:
            assert kv.pool.blocks[later].block_hash is not None


def test_free_order_after_the_untouched_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request(0, tokens(92, 2 * BS + 1))       # 3 blocks, 2 cached
    b = make_request(1, tokens(93, 3 * BS))           # 3 blocks, 3 cached
    admit(kv, a)
    admit(kv, b)
    a_ids, b_ids = list(a.block_ids), list(b.block_ids)
    assert free_ids(kv.pool) == [6, 7, 8, 9]
    kv.free(a)
    kv.free(b)
    assert free_ids(kv.pool) == [6, 7, 8, 9] + a_ids[::-1] + b_ids[::-1]
    # The untouched blocks go first; then A's partial (never cached) block, then A's cached ones.
    taken = kv.pool.allocate(5)
    assert [blk.block_id for blk in taken] == [6, 7, 8, 9, a_ids[2]]
    assert kv.pool.num_cached_blocks == 5
    taken = kv.pool.allocate(1)
    assert taken[0].block_id == a_ids[1] and kv.pool.num_cached_blocks == 4
    # A request with A's prompt now hits only A's first block (its second one was evicted).
    again = make_request(2, a.prompt_token_ids)
    assert [blk.block_id for blk in kv.get_computed_blocks(again)] == a_ids[:1]
    assert_pool_consistent(kv.pool)


def test_evicting_one_of_two_duplicate_blocks_keeps_the_hash() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = tokens(100, 2 * BS)
    a = make_request(0, prompt)
    b = make_request(1, prompt)
    # Both looked up in the same step, before either is cached: both miss, both fill blocks.
    hits_a, hits_b = kv.get_computed_blocks(a), kv.get_computed_blocks(b)
    assert hits_a == hits_b == []
    assert kv.allocate_slots(a, len(prompt)) and kv.allocate_slots(b, len(prompt))
    kv.cache_full_blocks(a, len(prompt))
    kv.cache_full_blocks(b, len(prompt))
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    h0, h1 = a.block_hashes[:2]
    assert b.block_hashes[:2] == [h0, h1]
    pool = kv.pool
    assert set(pool.cached[h0]) == {0, 2} and set(pool.cached[h1]) == {1, 3}
    assert pool.lookup(h0) is pool.blocks[0] and pool.lookup(h1) is pool.blocks[1]
    assert pool.num_cached_blocks == 4
    assert_pool_consistent(pool)

    kv.free(a)
    kv.free(b)
    assert free_ids(pool) == [1, 0, 3, 2]
    assert pool.allocate(1)[0].block_id == 1
    assert h1 in pool.cached and pool.lookup(h1) is pool.blocks[3]
    assert pool.allocate(1)[0].block_id == 0
    assert h0 in pool.cached and pool.lookup(h0) is pool.blocks[2]
    # A request now hits the remaining copies.
    c = make_request(2, prompt + [1])
    assert [blk.block_id for blk in kv.get_computed_blocks(c)] == [2, 3]
    assert pool.allocate(1)[0].block_id == 3
    assert h1 not in pool.cached and pool.lookup(h1) is None
    assert pool.lookup(h0) is pool.blocks[2]
    assert pool.allocate(1)[0].block_id == 2
    assert h0 not in pool.cached and pool.lookup(h0) is None
    assert pool.cached == {} and pool.num_cached_blocks == 0


def test_reset_clears_every_hash_and_is_refused_while_a_block_is_in_use() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request(0, tokens(110, 3 * BS + 1))
    b = make_request(1, tokens(111, 2 * BS))
    admit(kv, a)
    admit(kv, b)
    kv.free(b)
    assert kv.pool.num_cached_blocks == 5
    assert kv.reset_prefix_cache() is False             # A still holds blocks
    assert kv.pool.num_cached_blocks == 5
    assert kv.pool.lookup(a.block_hashes[0]) is not None
    assert kv.pool.lookup(b.block_hashes[0]) is not None

    kv.free(a)
    free_before = free_ids(kv.pool)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {} and kv.pool.num_cached_blocks == 0
    assert all(blk.block_hash is None for blk in kv.pool.blocks)
    assert free_ids(kv.pool) == free_before and kv.num_free_blocks == 8
    assert kv.get_computed_blocks(make_request(2, a.prompt_token_ids)) == []
    assert kv.get_computed_blocks(make_request(3, b.prompt_token_ids + [1])) == []
    # The pool keeps working and caching after a reset.
    c = make_request(4, a.prompt_token_ids)
    admit(kv, c)
    assert kv.pool.num_cached_blocks == 3
    assert_pool_consistent(kv.pool)


def test_counters_count_prompt_tokens_and_hit_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = tokens(120, 3 * BS + 2)
    a = make_request(0, prompt)
    kv.record_admission(a, len(admit(kv, a)) * BS)
    b = make_request(1, prompt)
    kv.record_admission(b, len(admit(kv, b)) * BS)
    assert kv.counters.queries == 2 * len(prompt)
    assert kv.counters.hits == 3 * BS
    assert kv.counters.hit_rate == pytest.approx(3 * BS / (2 * len(prompt)))


# ---------------------------------------------------------------------------- scheduler

def test_scheduler_second_request_is_admitted_after_its_cached_prefix() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=1024,
                          eos_token_ids=[EOS])
    prefix = tokens(130, 3 * BS)
    a = make_request(0, prefix + tokens(131, 3), max_tokens=3)
    b = make_request(1, prefix + tokens(132, 5), max_tokens=3)

    def run_step(step_index: int):
        step = scheduler.schedule()
        scheduler.maintain(step)                      # the server's order: plan out, maintain,
        sampled = [rid for rid, n in step.num_scheduled.items()   # then the result
                   if scheduler.requests[rid].num_computed_tokens + n
                   == scheduler.requests[rid].num_tokens]
        result = StepResult(step_id=step.plan.step_id, request_ids=sampled,
                            sampled_token_ids=[1000 + step_index] * len(sampled),
                            forward_ms=0.0, prepare_ms=0.0)
        scheduler.update(step, result)
        return step

    scheduler.add(a)
    first = run_step(0)
    assert [n.request_id for n in first.plan.new_requests] == [0]
    assert first.plan.new_requests[0].num_computed_tokens == 0
    assert first.plan.new_requests[0].num_scheduled_tokens == len(a.prompt_token_ids)
    assert kv.pool.num_cached_blocks == 3             # A's 3 full prompt blocks

    scheduler.add(b)
    second = run_step(1)
    (new_b,) = second.plan.new_requests
    assert new_b.request_id == 1
    assert new_b.num_computed_tokens == 3 * BS
    assert new_b.num_scheduled_tokens == len(b.prompt_token_ids) - 3 * BS
    assert new_b.block_ids[:3] == a.block_ids[:3]
    assert not set(new_b.block_ids[3:]) & set(a.block_ids)
    assert refs(kv, a.block_ids[:3]) == [2, 2, 2]
    assert second.plan.cached_request_ids == [0] and second.plan.cached_num_scheduled_tokens == [1]
    assert kv.counters.queries == len(a.prompt_token_ids) + len(b.prompt_token_ids)
    assert kv.counters.hits == 3 * BS

    step_index = 2
    while scheduler.has_work:
        assert step_index < 20
        run_step(step_index)
        step_index += 1
    assert a.status is RequestStatus.FINISHED and b.status is RequestStatus.FINISHED
    assert a.status is RequestStatus.FINISHED and len(a.output_token_ids) == 3
    assert len(b.output_token_ids) == 3
    scheduler.maintain(None)
    assert kv.num_free_blocks == kv.num_blocks
    assert all(blk.ref_count == 0 for blk in kv.pool.blocks)
    # Still cached: the shared prefix, and each request's other full blocks.
    for index, block_hash in enumerate(a.block_hashes[:3]):
        assert kv.pool.lookup(block_hash) is kv.pool.blocks[new_b.block_ids[index]]
    assert kv.pool.num_cached_blocks == 5             # + A's and B's 4th blocks, filled by decode
    assert_pool_consistent(kv.pool)
    again = make_request(2, prefix + tokens(133, 2))
    assert len(kv.get_computed_blocks(again)) == 3
