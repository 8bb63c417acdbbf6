"""The KV block pool: blocks with reference counts, the free-block queue (also the eviction
order), and the map from block hash to cached blocks that makes prefix caching work."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

BlockHash = bytes


class KVBlock:
    """One block of the worker KV cache, as the scheduler accounts for it."""

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        # Intrusive links of the free-block queue: O(1) removal of a block that gets a hit.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, refs={self.ref_count}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks. The head is evicted (reused) first.

    Blocks are appended when their last reference goes away, so the order is least recently
    used first; `remove` takes a block out of the middle in O(1) when a request hits it.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)   # sentinels: no None checks on the hot path
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._length

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._length -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._length += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All blocks of the cache, the free queue, and hash -> cached blocks.

    Several blocks may carry the same hash (block tables are append-only, so two requests can
    fill identical blocks); a lookup returns the first one cached, which concentrates hits.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, dict[int, KVBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.cached.values())

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        blocks = self.cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue; a cached one loses its hash."""
        if count > len(self.free_queue):
            raise ValueError(f"asked for {count} blocks, {len(self.free_queue)} free")
        taken = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each hit block; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop a reference from each; blocks reaching zero join the queue in the given order."""
        for block in ordered_blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        same_hash = self.cached.get(block.block_hash)
        if same_hash is not None:
            same_hash.pop(block.block_id, None)
            if not same_hash:
                del self.cached[block.block_hash]
        block.block_hash = None
