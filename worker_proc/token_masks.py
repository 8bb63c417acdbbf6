"""Structured outputs in the worker: the scheduler's token bitmasks applied to the logits of the
rows they constrain, before penalties' results are sampled (greedy or not), so a constrained
request can only sample what its grammar allows next."""
from __future__ import annotations

import numpy as np
import torch


def expand_masks(masks: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bitmasks (bit t of little-endian 32-bit word t // 32) as a [len(masks), vocab_size] bool
    tensor on `device`; tokens past a mask's end are not allowed."""
    packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(masks), -1)
    # Little-endian words: bit t is bit t % 8 of byte t // 8, which "little" unpacks to place t.
    bits = np.unpackbits(packed, axis=1, count=min(vocab_size, packed.shape[1] * 8),
                         bitorder="little")
    allowed = torch.from_numpy(bits).to(device, non_blocking=True).bool()
    if allowed.shape[1] == vocab_size:
        return allowed
    pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=device)
    return torch.cat([allowed, pad], dim=1)


def split_masks(packed: bytes, count: int) -> list[bytes]:
    """A verified run's `count` row masks, sent concatenated (equal lengths)."""
    size = len(packed) // count
    if size * count != len(packed):
        raise ValueError(f"{len(packed)} mask bytes do not split into {count} rows")
    return [packed[i * size:(i + 1) * size] for i in range(count)]


def apply_token_masks(logits: torch.Tensor, sample_ids: list[int],
                      masks: dict[int, bytes]) -> torch.Tensor:
    """logits [rows, vocab], one row per id of sample_ids: the rows of constrained requests
    with every token their mask refuses at -inf (a new tensor; the input is left alone, as
    the raw logits also give the log-probabilities)."""
    rows = [row for row, rid in enumerate(sample_ids) if rid in masks]
    if not rows:
        return logits
    allowed = expand_masks([masks[sample_ids[row]] for row in rows], logits.shape[1], logits.device)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, constrained)
