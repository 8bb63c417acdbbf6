"""The scheduler's view of the CPU swap space: which CPU blocks hold offloaded KV blocks."""
from __future__ import annotations


class CpuBlockPool:
    """CPU blocks of every worker's swap space (the same ids on every rank).

    No hashing and no sharing: a swapped-out request owns its CPU blocks until it is swapped
    back in, finishes or is aborted.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` CPU blocks, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
