"""The KV cache of a model mixing full-attention and sliding-window layers (Gemma 2 and 3, Qwen2
with use_sliding_window on some layers): two block pools, the full layers' and the windowed
layers' (whose caches the workers allocate apart), and for each request a block table in each.
The windowed table frees the blocks its window leaves, so that pool holds at most a window and
a chunk per request, while the full-attention pool holds every request's whole context.

HybridKVCacheManager keeps KVCacheManager's API: a request fits when it fits both pools, and a
prefix hit counts where the full pool holds its blocks and the windowed pool those its window
still reaches.
"""
from __future__ import annotations

from spmd_runtime.scheduler_proc.block_pool import KVBlock
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.request import Request


class SlidingTable:
    """A request's block table in the windowed layers' pool. KVCacheManager reads everything
    else (tokens, computed count, block hashes, parameters) through it from the request."""

    __slots__ = ("request", "block_ids", "num_cached_blocks", "num_blocks_slid",
                 "num_blocks_sent")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0
        self.num_blocks_slid = 0
        # How many of block_ids the workers hold (PlanBuilder).
        self.num_blocks_sent = 0

    def __getattr__(self, name: str):
        return getattr(self.request, name)


def sliding_table(request: Request) -> SlidingTable:
    if request.sliding is None:
        request.sliding = SlidingTable(request)
    return request.sliding


class HybridKVCacheManager:
    """The full-attention layers' KVCacheManager (whose pool the scheduler's figures and the
    prefix-cache counters are) and the windowed layers' one, used together."""

    sliding_window = None           # the full-attention layers bound each request's context

    def __init__(self, full: KVCacheManager, sliding: KVCacheManager) -> None:
        self.full, self.sliding = full, sliding
        self.num_blocks, self.block_size = full.num_blocks, full.block_size
        self.enable_caching = full.enable_caching
        self.pool, self.counters = full.pool, full.counters

    @property
    def window_pool(self) -> KVCacheManager:
        return self.sliding

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Full-attention hits as far as the windowed pool holds the blocks within the window
        of the token after them."""
        hits = self.full.get_computed_blocks(request)
        return hits[:len(self.sliding.hits_in_window(sliding_table(request), len(hits)))]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = (), reserve: int = 0) -> bool:
        """Room in both pools, or (but for the windowed blocks that left the window) no change."""
        table = sliding_table(request)
        sliding_hits = self.sliding.hits_in_window(table, len(computed_blocks))
        if len(sliding_hits) != len(computed_blocks):
            return False        # not a get_computed_blocks answer
        self.sliding.slide_window(table, request.num_computed_tokens)
        full = self.full.blocks_to_take(request, num_new_tokens, computed_blocks)
        windowed = self.sliding.blocks_to_take(table, num_new_tokens, sliding_hits)
        if (full + reserve > self.full.num_free_blocks
                or windowed + reserve > self.sliding.num_free_blocks):
            return full <= 0 and windowed <= 0 and not computed_blocks
        self.full.take(request, num_new_tokens, computed_blocks)
        self.sliding.take(table, num_new_tokens, sliding_hits)
        return True

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        self.full.record_admission(request, num_hit_tokens)

    def cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        self.full.cache_full_blocks(request, num_known_tokens)
        self.sliding.cache_full_blocks(sliding_table(request), num_known_tokens)

    def free(self, request: Request) -> None:
        self.full.free(request)
        self.sliding.free(sliding_table(request))

    def reset_prefix_cache(self) -> bool:
        return self.full.reset_prefix_cache() and self.sliding.reset_prefix_cache()
