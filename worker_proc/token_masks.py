"""Structured outputs in the worker: the scheduler's token bitmasks applied to the logits of the
rows they constrain, before penalties' results are sampled (greedy or not), so a constrained
request can only sample what its grammar allows next."""
from __future__ import annotations

import numpy as np
import torch


def expand_masks(masks: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bitmasks (bit t of little-endian 32-bit word t // 32) as a [len(masks), vocab_size] bool
    tensor on `device`; tokens past a mask's end are not allowed."""
    words = np.stack([np.frombuffer(mask, dtype="<i4") for mask in masks])
    words = torch.from_numpy(words).to(device, non_blocking=True)
    bits = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32, device=device),
                                    torch.arange(32, dtype=torch.int32, device=device))
    allowed = (words.unsqueeze(-1) & bits).ne(0).flatten(1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_masks(logits: torch.Tensor, sample_ids: list[int],
                      masks: dict[int, bytes]) -> torch.Tensor:
    """logits [rows, vocab], one row per id of sample_ids: the rows of constrained requests
    with every token their mask refuses at -inf (a new tensor; the input is left alone)."""
    rows = [row for row, rid in enumerate(sample_ids) if rid in masks]
    if not rows:
        return logits
    allowed = expand_masks([masks[sample_ids[row]] for row in rows], logits.shape[1], logits.device)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked
