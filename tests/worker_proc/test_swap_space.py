"""The CPU swap space of a worker, alone and inside ModelRunner.execute.

* SwapSpace: blocks copied out and back into *other* device blocks come back bit for bit, in
  every layer's K and V, and nothing else changes; with mixed windows, each pool's blocks.
* ModelRunner: a request swapped out in the middle of its generation, whose device blocks are
  then reused (cleared and overwritten) by other requests, and swapped back into new blocks
  (its last block only partly filled) gives the same logits as a run that never swapped, and as
  transformers. The plan's documented order -- swap_out, clearing fresh blocks, swap_in -- is
  what makes a block swapped out and handed to another request in the same step work.
Plans go through the msgspec wire encoding, as the scheduler sends them.
"""
from __future__ import annotations

import pytest
import torch
from spmd_runtime.protocol.messages import StepPlan, worker_inbound_decoder
from spmd_runtime.protocol.transport import Encoder
from spmd_runtime.worker_proc.kv_cache import allocate_kv_cache
from spmd_runtime.worker_proc.model_runner import ModelRunner
from spmd_runtime.worker_proc.swap_space import SwapSpace
from test_model_runner import (
    BLOCK,
    NUM_BLOCKS,
    STALE,
    Harness,
    assert_close,
    build_pair,
    prompt,
    reference_logits,
)

NUM_CPU_BLOCKS = 16


def block(tensor: torch.Tensor, block_id: int) -> torch.Tensor:
    """The slots of one block of a [num_blocks * BLOCK, heads, dim] cache tensor."""
    return tensor.view(-1, BLOCK, *tensor.shape[1:])[block_id]


def snapshot(kv_caches, block_ids) -> list[torch.Tensor]:
    """Every layer's K and V of the given blocks, copied."""
    return [torch.stack([block(t, b) for b in block_ids]).clone()
            for cache in kv_caches for t in cache]


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=3)


# ---------------------------------------------------------------------------- SwapSpace alone

def random_cache(config, num_blocks: int, seed: int):
    kv = allocate_kv_cache(config, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for cache in kv:
        for tensor in cache:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return kv


def test_swap_round_trip_into_other_device_blocks(pair) -> None:
    _, _, config = pair
    kv = random_cache(config, 12, seed=0)
    swap = SwapSpace(kv, 6, BLOCK)
    assert swap.num_blocks == 6
    out_pairs = [(1, 4), (7, 0), (2, 5)]
    saved = snapshot(kv, [1, 7, 2])
    swap.swap_out(out_pairs)
    # The device blocks are handed to other requests and overwritten.
    for cache in kv:
        for tensor in cache:
            for b in (1, 7, 2):
                block(tensor, b).fill_(-3.0)
    untouched_ids = [0, 1, 2, 4, 5, 7, 8, 9, 11]
    untouched = snapshot(kv, untouched_ids)
    # Back into different device blocks, in another order.
    swap.swap_in([(10, 5), (3, 4), (6, 0)])
    restored = snapshot(kv, [3, 6, 10])
    for before, after in zip(saved, restored, strict=True):
        assert torch.equal(before, after)
    for before, after in zip(untouched, snapshot(kv, untouched_ids), strict=True):
        assert torch.equal(before, after), "swap_in wrote outside its target blocks"


def test_a_cpu_block_holds_a_block_of_each_pool_of_mixed_windows(pair) -> None:
    """A model mixing full and windowed layers (layer 1 windowed here, its pool of 5 blocks):
    CPU block c takes full pool block f in the full layers and windowed pool block w in the
    windowed ones, and gives each back to its own pool, the other pool untouched."""
    import dataclasses

    _, _, config = pair
    mixed = dataclasses.replace(config, sliding_window=32, sliding_layers=(1,))
    kv = allocate_kv_cache(mixed, 12, BLOCK, torch.float32, torch.device("cpu"),
                           num_sliding_blocks=5)
    generator = torch.Generator().manual_seed(4)
    for cache in kv:
        for tensor in cache:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    swap = SwapSpace(kv, 3, BLOCK, sliding_layers=(1,))
    full_before = [block(t, 7).clone() for t in kv[0]]
    windowed_before = [block(t, 2).clone() for t in kv[1]]
    swap.swap_out([(7, 1)], [(2, 1)])
    untouched = [block(t, 9).clone() for t in kv[0]] + [block(t, 4).clone() for t in kv[1]]
    swap.swap_in([(9, 1)], [(4, 1)])
    assert all(torch.equal(block(t, 9), b) for t, b in zip(kv[0], full_before, strict=True))
    assert all(torch.equal(block(t, 4), b) for t, b in zip(kv[1], windowed_before, strict=True))
    assert not torch.equal(block(kv[0][0], 9), untouched[0])
    # The windowed pool's block 9 does not exist; the full pool's block 4 was not written.
    assert kv[1][0].shape[0] == 5 * BLOCK
    assert not torch.equal(block(kv[0][0], 4), windowed_before[0])


def test_swap_space_blocks_are_independent_and_reusable(pair) -> None:
    _, _, config = pair
    kv = random_cache(config, 8, seed=1)
    swap = SwapSpace(kv, 3, BLOCK)
    first = snapshot(kv, [0, 1, 2])
    swap.swap_out([(0, 0), (1, 1), (2, 2)])
    # CPU block 1 is freed and reused for another device block; 0 and 2 must not change.
    second = snapshot(kv, [5])
    swap.swap_out([(5, 1)])
    swap.swap_in([(7, 0), (6, 1), (4, 2)])
    got = snapshot(kv, [7, 6, 4])
    for layer, (a, b, c) in enumerate(zip(first, second, got, strict=True)):
        assert torch.equal(c[0], a[0]), f"view {layer}: CPU block 0"
        assert torch.equal(c[1], b[0]), f"view {layer}: CPU block 1 (reused)"
        assert torch.equal(c[2], a[2]), f"view {layer}: CPU block 2"


def test_no_swap_space_and_empty_copies_are_no_ops(pair) -> None:
    _, _, config = pair
    kv = random_cache(config, 4, seed=2)
    before = snapshot(kv, range(4))
    swap = SwapSpace(kv, 0, BLOCK)
    assert swap.num_blocks == 0 and swap.cpu_views == []
    swap.swap_out([])
    swap.swap_in([])
    for a, b in zip(before, snapshot(kv, range(4)), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- inside ModelRunner

class SwapHarness(Harness):
    """Harness whose runner has a swap space and whose plans carry swap copies."""

    def __init__(self, model, config, fill: float = 0.0) -> None:
        super().__init__(model, config, fill)
        self.runner = ModelRunner(model, self.runner.kv_caches, BLOCK, torch.device("cpu"),
                                  seed=0, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.encoder = Encoder()
        self.decoder = worker_inbound_decoder()

    def run(self, new=(), cached=(), dropped=(), swap_out=(), swap_in=()):
        runner = self.runner
        execute = type(runner).execute

        def execute_with_swaps(plan: StepPlan):
            plan.swap_out = [tuple(p) for p in swap_out]
            plan.swap_in = [tuple(p) for p in swap_in]
            wire = self.decoder.decode(self.encoder.encode(plan))
            return execute(runner, wire)

        runner.execute = execute_with_swaps
        try:
            return super().run(new, cached, dropped)
        finally:
            del runner.execute


def test_swapped_out_request_resumes_with_the_same_logits(pair) -> None:
    """A (request 0) runs with B, is swapped out while C takes its device blocks in the same
    step, then comes back (into blocks that B had until B was swapped out in that very step)
    with 11 computed tokens: blocks of 4, so its last block holds 3."""
    hf, model, config = pair
    h = SwapHarness(model, config, fill=STALE)
    a, b, c = prompt(60, 10), prompt(61, 7), prompt(62, 9)
    a_blocks, b_blocks = [3, 7, 9], [12, 13]

    # Step 1-2: A and B prefill, then decode once: A has 11 computed tokens, 12 known.
    _, sampled = h.run(new=[(0, a, a_blocks, 0, 10), (1, b, b_blocks, 0, 7)])
    a.append(sampled[0])
    b.append(sampled[1])
    _, sampled = h.run(cached=[(0, 1, []), (1, 1, [])])
    a.append(sampled[0])
    b.append(sampled[1])
    assert len(a) == 12 and h.runner.requests[0].num_computed_tokens == 11
    a_kv = snapshot(h.runner.kv_caches, a_blocks)

    # Step 3: A is swapped out; C (new) gets A's blocks 9, 3 and 7 -- cleared as fresh, then
    # written by C's prefill. The swap-out must run before the clearing.
    logits, sampled = h.run(new=[(2, c, [9, 3, 7], 0, 9)], cached=[(1, 1, [14])], dropped=[0],
                            swap_out=[(3, 5), (7, 2), (9, 11)])
    assert 0 not in h.runner.requests
    assert_close(logits[2], reference_logits(hf, c), "C over A's old blocks")
    assert_close(logits[1], reference_logits(hf, b)[-1:], "B beside the swap-out")
    c.append(sampled[2])
    b.append(sampled[1])
    assert not torch.equal(snapshot(h.runner.kv_caches, [3])[0][0], a_kv[0][0]), \
        "C should have overwritten A's old block"
    cpu = h.runner.swap_space.cpu_views
    for view, saved in zip(cpu, a_kv, strict=True):
        held = torch.equal(view[[5, 2, 11]].view_as(saved), saved)
        assert held, "the swap space should hold A's KV blocks"

    # Step 4: B (9 computed tokens) is swapped out, its blocks 12, 13, 14 -> CPU 0, 1, 6, and
    # A is swapped back into 13, 12 and 14 in the same step. The order matters twice: B's
    # copy-out must precede the clearing of A's fresh block 14 (B's partly filled last block),
    # and that clearing (A's last block holds 3 of 4 tokens) must precede A's swap-in.
    logits, sampled = h.run(
        new=[(0, a, [13, 12, 14], 11, 1)], cached=[(2, 1, [])], dropped=[1],
        swap_out=[(12, 0), (13, 1), (14, 6)], swap_in=[(13, 5), (12, 2), (14, 11)])
    assert_close(logits[0], reference_logits(hf, a)[-1:], "A after swap-in")
    assert_close(logits[2], reference_logits(hf, c)[-1:], "C decode")
    assert h.runner.requests[0].num_computed_tokens == 12
    assert h.runner.block_tables.block_ids(0) == [13, 12, 14]
    a.append(sampled[0])
    c.append(sampled[2])

    # Step 5: A decodes on, crossing into a new block (position 12 starts its 4th block); B is
    # swapped back in, its last block partly filled too.
    assert len(b) == 10
    logits, sampled = h.run(cached=[(0, 1, [50]), (2, 1, [])],
                            new=[(1, b, [30, 31, 32], 9, 1)],
                            swap_in=[(30, 0), (31, 1), (32, 6)])
    for rid, seq in ((0, a), (1, b), (2, c)):
        assert_close(logits[rid], reference_logits(hf, seq)[-1:], f"request {rid} after swaps")
        seq.append(sampled[rid])
    logits, sampled = h.run(cached=[(0, 1, []), (1, 1, []), (2, 1, [])])
    for rid, seq in ((0, a), (1, b), (2, c)):
        assert_close(logits[rid], reference_logits(hf, seq)[-1:], f"request {rid} decode")
        seq.append(sampled[rid])

    # The same tokens without any swap: identical next-token logits for A.
    plain = Harness(model, config)
    tokens = a[:10]
    _, sampled = plain.run(new=[(0, tokens, [1, 2, 4, 5], 0, 10)])
    for _ in range(len(a) - 10):
        assert sampled[0] == a[len(tokens)], "greedy tokens differ from the swapping run"
        tokens.append(sampled[0])
        plain_logits, sampled = plain.run(cached=[(0, 1, [])])
    swapped_logits, _ = h.run(cached=[(0, 1, [])], dropped=[1, 2])
    assert_close(swapped_logits[0], plain_logits[0], "A with swaps vs A without")


def test_housekeeping_plan_swaps_out_without_a_forward_pass(pair) -> None:
    """A stalled scheduler sends a plan that computes nothing but forgets and offloads a
    request; its blocks are reused before it is swapped back in."""
    hf, model, config = pair
    h = SwapHarness(model, config, fill=STALE)
    a, d = prompt(70, 8), prompt(71, 6)
    _, sampled = h.run(new=[(0, a, [20, 21], 0, 8)])
    a.append(sampled[0])
    logits, outputs = h.run(dropped=[0], swap_out=[(20, 3), (21, 4)])
    assert logits == {} and outputs == {} and h.runner.requests == {}
    # Full blocks only (8 computed tokens = 2 blocks); D reuses them.
    _, _ = h.run(new=[(1, d, [21, 20], 0, 6)])
    logits, sampled = h.run(new=[(0, a, [7, 8, 9], 8, 1)], dropped=[1],
                            swap_in=[(7, 3), (8, 4)])
    assert_close(logits[0], reference_logits(hf, a)[-1:], "A after a housekeeping swap-out")
    assert sampled[0] == int(reference_logits(hf, a)[-1].argmax())


def test_swap_in_at_a_block_boundary(pair) -> None:
    """8 computed tokens fill two blocks exactly: both are swapped in over stale content, and
    only the third block (for the next token) is fresh."""
    hf, model, config = pair
    h = SwapHarness(model, config)
    a = prompt(80, 8)           # exactly two full blocks
    _, sampled = h.run(new=[(0, a, [1, 2, 3], 0, 8)])
    a.append(sampled[0])
    h.run(dropped=[0], swap_out=[(1, 0), (2, 1)])
    for cache in h.runner.kv_caches:
        for tensor in cache:
            block(tensor, 10).fill_(7.0)
            block(tensor, 11).fill_(7.0)
    logits, _ = h.run(new=[(0, a, [10, 11, 12], 8, 1)], swap_in=[(10, 0), (11, 1)])
    assert_close(logits[0], reference_logits(hf, a)[-1:], "A resumed at a block boundary")


def test_model_runner_swap_space_has_the_requested_size(pair) -> None:
    _, model, config = pair
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, BLOCK, torch.device("cpu"), seed=0, num_cpu_blocks=5)
    assert runner.swap_space.num_blocks == 5
    assert len(runner.swap_space.cpu_views) == 2 * config.num_hidden_layers
    per_block = BLOCK * config.num_key_value_heads * config.head_dim
    assert all(v.shape == (5, per_block) for v in runner.swap_space.cpu_views)
    assert ModelRunner(model, kv, BLOCK, torch.device("cpu"), seed=0).swap_space.num_blocks == 0
