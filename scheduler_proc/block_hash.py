"""Chained hashes of full KV blocks: a block's hash covers its parent's hash, its token ids and
extra keys (the cache salt), so equal hashes mean equal prefixes. SHA-256, never hash()."""
from __future__ import annotations

import hashlib
from array import array

from spmd_runtime.scheduler_proc.block_pool import BlockHash


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    digest = hashlib.sha256()
    digest.update(parent or b"\x00")
    digest.update(len(extra).to_bytes(4, "little"))
    digest.update(extra)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], block_size: int,
                        cache_salt: str | None) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet."""
    num_full = len(token_ids) // block_size
    for index in range(len(hashes), num_full):
        parent = hashes[-1] if hashes else None
        # The salt enters the first block only: it then changes every hash after it.
        extra = cache_salt.encode() if index == 0 and cache_salt else b""
        hashes.append(hash_block(parent, token_ids[index * block_size:(index + 1) * block_size],
                                 extra))
