"""Chained block hashes: parent, tokens and the cache salt (first block only)."""
from __future__ import annotations

import random

from spmd_runtime.scheduler_proc.block_hash import extend_block_hashes, hash_block

BS = 4       # small blocks keep the token arithmetic readable


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(count)]


# ---------------------------------------------------------------------------- hashing

def test_block_hashes_chain_and_salt_enters_only_the_first_block() -> None:
    ids = tokens(1, 3 * BS + 2)
    plain: list[bytes] = []
    extend_block_hashes(plain, ids, BS, None)
    assert len(plain) == 3                          # the partial block is not hashed
    assert plain[0] == hash_block(None, ids[:BS])
    assert plain[1] == hash_block(plain[0], ids[BS:2 * BS])
    assert plain[2] == hash_block(plain[1], ids[2 * BS:3 * BS])
    salted: list[bytes] = []
    extend_block_hashes(salted, ids, BS, "tenant")
    assert salted[0] == hash_block(None, ids[:BS], b"tenant")
    assert salted[1] == hash_block(salted[0], ids[BS:2 * BS])       # no extra after block 0
    assert all(a != b for a, b in zip(plain, salted, strict=True))   # ...but every hash differs
    # Extending only appends what is missing; existing entries are kept.
    grown = list(plain[:1])
    extend_block_hashes(grown, ids + tokens(2, 2), BS, None)
    assert grown == plain + [hash_block(plain[2], (ids + tokens(2, 2))[3 * BS:4 * BS])]
    # Different content at any block changes that block's hash and every later one.
    other = list(ids)
    other[BS] += 1
    changed: list[bytes] = []
    extend_block_hashes(changed, other, BS, None)
    assert changed[0] == plain[0] and changed[1] != plain[1] and changed[2] != plain[2]
