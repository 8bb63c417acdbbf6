"""Per-request KV-cache block accounting: how many blocks a request needs, allocate, free."""
from __future__ import annotations

from collections import deque

from scheduler_proc.request import Request


class KVCacheManager:
    """Owns the block ids of the worker KV cache; a request holds blocks for its computed tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Give `request` room for `num_new_tokens` more tokens; False (and no change) if it does not fit."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            return False
        request.block_ids.extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, request: Request) -> None:
        self._free.extend(request.block_ids)
        request.block_ids = []
        request.num_blocks_sent = 0
