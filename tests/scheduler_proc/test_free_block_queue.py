"""FreeBlockQueue: order, and O(1) removal of a block from the middle."""
from __future__ import annotations

import random
import time

import pytest
from spmd_runtime.scheduler_proc.block_pool import FreeBlockQueue, KVBlock

# ---------------------------------------------------------------------------- FreeBlockQueue

def test_free_queue_remove_from_middle_keeps_order_and_touches_only_neighbours(monkeypatch) -> None:
    blocks = [KVBlock(i) for i in range(10)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 10 and [b.block_id for b in queue] == list(range(10))

    # remove() must not walk the list: make walking it an error while removing.
    def no_walk(self):
        raise AssertionError("FreeBlockQueue.remove walked the queue")
        yield  # pragma: no cover

    with monkeypatch.context() as patch:
        patch.setattr(FreeBlockQueue, "__iter__", no_walk)
        queue.remove(blocks[5])
        queue.remove(blocks[0])     # head
        queue.remove(blocks[9])     # tail
    assert [b.block_id for b in queue] == [1, 2, 3, 4, 6, 7, 8]
    assert len(queue) == 7
    assert blocks[4].next_free is blocks[6] and blocks[6].prev_free is blocks[4]
    assert blocks[5].prev_free is None and blocks[5].next_free is None
    with pytest.raises(ValueError):
        queue.remove(blocks[5])     # not in the queue any more
    assert len(queue) == 7
    queue.append(blocks[5])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 2, 3, 4, 6, 7, 8, 5, 0]
    assert [queue.popleft().block_id for _ in range(9)] == [1, 2, 3, 4, 6, 7, 8, 5, 0]
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_free_queue_remove_is_constant_time() -> None:
    """Removing every block of a 200k-block queue in random order: linear in total if each
    removal is O(1), ~10^10 steps if a removal scans the queue."""
    n = 200_000
    blocks = [KVBlock(i) for i in range(n)]
    queue = FreeBlockQueue(blocks)
    order = list(range(n))
    random.Random(0).shuffle(order)
    keep = set(order[-1000:])
    started = time.perf_counter()
    for index in order[:-1000]:
        queue.remove(blocks[index])
    elapsed = time.perf_counter() - started
    assert elapsed < 10.0, f"{n - 1000} removals took {elapsed:.1f}s"
    assert len(queue) == 1000
    assert [b.block_id for b in queue] == sorted(keep)
