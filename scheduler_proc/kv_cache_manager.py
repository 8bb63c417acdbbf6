"""Per-request KV-cache API over the block pool: prefix hits, allocate, cache full blocks, free."""
from __future__ import annotations

from dataclasses import dataclass

from spmd_runtime.protocol.messages import FREED_BLOCK
from spmd_runtime.scheduler_proc.block_hash import extend_block_hashes
from spmd_runtime.scheduler_proc.block_pool import BlockPool, KVBlock
from spmd_runtime.scheduler_proc.request import Request


@dataclass
class PrefixCacheCounters:
    queries: int = 0     # prompt tokens looked up at admission
    hits: int = 0        # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """A request holds blocks for the tokens it has computed or is computing this step; under a
    sliding window on every layer, only for those its next tokens still attend to."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Most blocks in use at once (counted where allocation takes the general path: always
        # under a window).
        self.peak_blocks_in_use = 0
        self.pool = BlockPool(num_blocks, enable_caching)
        self.counters = PrefixCacheCounters()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> list[KVBlock | None]:
        """Cached blocks holding a prefix of the request's tokens (changes nothing).

        Stops at the first miss, and never covers the last token: its logits must be computed.
        None for a request with prompt_logprobs, which needs the logits of every prompt position.
        Under a sliding window, the longest prefix whose blocks within the window of its next
        token are cached: the blocks before that window are None (no query attends to them).
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens, self.block_size, request.params.cache_salt)
        if self.sliding_window:
            return self.hits_in_window(request, (len(tokens) - 1) // self.block_size)
        hits = []
        for block_hash in request.block_hashes[:(len(tokens) - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def hits_in_window(self, request: Request, most: int) -> list[KVBlock | None]:
        """Under a sliding window: the hits of the longest prefix of at most `most` blocks
        (hashed already) whose blocks within the window of the token after it are cached,
        None before that window."""
        present = [self.pool.lookup(block_hash) for block_hash in request.block_hashes[:most]]
        missing = -1                        # the last block not cached, before `length`
        longest = 0
        for length in range(1, most + 1):
            if present[length - 1] is None:
                missing = length - 1
            if missing < self._blocks_before_window(length * self.block_size):
                longest = length
        first = self._blocks_before_window(longest * self.block_size)
        return [None] * first + present[first:longest]

    def blocks_needed(self, request: Request, num_new_tokens: int,
                      computed_blocks: list[KVBlock] = ()) -> int:
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids) - len(computed_blocks))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = (), reserve: int = 0) -> bool:
        """Room for `num_new_tokens` more tokens, after `computed_blocks` (prefix hits), leaving
        at least `reserve` blocks free. The hits' tokens count as computed once the caller
        (the scheduler, which owns num_computed_tokens) adds them.

        Hit blocks sitting in the free queue count against the free blocks. A request that does
        not fit changes nothing, not even a reference count (under a sliding window, but for
        the blocks that left it: they go back to the pool whatever happens).
        """
        if not computed_blocks and not self.sliding_window:
            # The per-step path of every running request: no hits, usually no new block.
            needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) \
                - len(request.block_ids)
            if needed <= 0:
                return True
            if needed + reserve > self.pool.num_free_blocks:
                return False
            request.block_ids.extend(block.block_id for block in self.pool.allocate(needed))
            return True
        self.slide_window(request, request.num_computed_tokens)
        taken = self.blocks_to_take(request, num_new_tokens, computed_blocks)
        if taken + reserve > self.pool.num_free_blocks:
            return taken <= 0 and not computed_blocks
        self.take(request, num_new_tokens, computed_blocks)
        return True

    def blocks_to_take(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = ()) -> int:
        """How many blocks allocate_slots would take out of the free queue: new ones, and hits
        sitting in it. Under a window, positions before it need no block."""
        first = request.num_computed_tokens + len(computed_blocks) * self.block_size
        have = len(request.block_ids) + len(computed_blocks)
        if self.sliding_window and not computed_blocks:
            have = max(have, self._blocks_before_window(first))
        reviving = sum(1 for block in computed_blocks if block is not None and block.ref_count == 0)
        return -(-(first + num_new_tokens) // self.block_size) - have + reviving

    def take(self, request: Request, num_new_tokens: int,
             computed_blocks: list[KVBlock] = ()) -> None:
        """allocate_slots once it fits (blocks_to_take within the free blocks)."""
        first = request.num_computed_tokens + len(computed_blocks) * self.block_size
        ids = request.block_ids
        if computed_blocks:
            # Hits first: they leave the free queue before new blocks are popped from it.
            # Under a window, those before it are None: no block at all.
            self.pool.touch(block for block in computed_blocks if block is not None)
            ids.extend(FREED_BLOCK if block is None else block.block_id
                       for block in computed_blocks)
            request.num_cached_blocks = len(computed_blocks)
            request.num_blocks_slid = sum(1 for block in computed_blocks if block is None)
        elif self.sliding_window and len(ids) < self._blocks_before_window(first):
            # Back from the swap space: positions before the window get no block.
            ids.extend([FREED_BLOCK] * (self._blocks_before_window(first) - len(ids)))
            request.num_blocks_slid = len(ids)
        needed = -(-(first + num_new_tokens) // self.block_size) - len(ids)
        if needed > 0:
            ids.extend(block.block_id for block in self.pool.allocate(needed))
        self.slide_window(request, first)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use,
                                      self.num_blocks - self.pool.num_free_blocks)

    @property
    def window_pool(self) -> KVCacheManager | None:
        """The pool of the model's sliding-window layers: this one if every layer has it."""
        return self if self.sliding_window else None

    def _blocks_before_window(self, first_position: int) -> int:
        """Blocks wholly before the window of the query at `first_position`."""
        return max(0, first_position - self.sliding_window + 1) // self.block_size

    def slide_window(self, request: Request, first_position: int) -> None:
        """Under a sliding window of W tokens, the query at `first_position` (the request's next
        token) and every later one attend to positions > first_position - W only: the blocks
        wholly before that go back to the pool (their hashes kept: a prompt sharing them can
        still hit). The in-flight step may still read them: only a later step writes a block
        given out again."""
        if not self.sliding_window:
            return
        num_out = min(self._blocks_before_window(first_position), len(request.block_ids))
        if num_out <= request.num_blocks_slid:
            return
        ids, blocks = request.block_ids, self.pool.blocks
        self.pool.free(blocks[ids[i]] for i in range(num_out - 1, request.num_blocks_slid - 1, -1))
        ids[request.num_blocks_slid:num_out] = [FREED_BLOCK] * (num_out - request.num_blocks_slid)
        request.num_blocks_slid = num_out

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.counters.queries += request.num_tokens
            self.counters.hits += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        """Hash and cache the request's blocks that `num_known_tokens` tokens fill completely."""
        if not self.enable_caching:
            return
        num_full = min(num_known_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        tokens = request.all_token_ids[:num_full * self.block_size]
        extend_block_hashes(request.block_hashes, tokens, self.block_size, request.params.cache_salt)
        blocks = self.pool.blocks
        for index in range(max(request.num_cached_blocks, request.num_blocks_slid), num_full):
            self.pool.cache(blocks[request.block_ids[index]], request.block_hashes[index])
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first: among blocks freed together, the
        one with the longest prefix is the least likely to be shared, so it is evicted first."""
        blocks = self.pool.blocks
        self.pool.free(blocks[block_id]
                       for block_id in reversed(request.block_ids[request.num_blocks_slid:]))
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_blocks_slid = 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
