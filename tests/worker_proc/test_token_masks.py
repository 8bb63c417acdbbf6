"""The worker's side of structured outputs: the scheduler's bitmasks applied to the logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from spmd_runtime.worker_proc.token_masks import apply_token_masks, expand_masks, split_masks

CPU = torch.device("cpu")


def bitmask(allowed: list[int], words: int) -> bytes:
    """The wire form: bit t of little-endian 32-bit word t // 32."""
    packed = np.zeros(words, dtype="<u4")
    for token in allowed:
        packed[token // 32] |= np.uint32(1 << (token % 32))
    return packed.tobytes()


def test_bits_expand_to_the_tokens_they_name_and_nothing_past_the_mask() -> None:
    allowed = [0, 5, 31, 32, 63, 64, 95]
    mask = expand_masks([bitmask(allowed, 3)], 100, CPU)     # 96 bits for a 100-token vocab
    assert mask.shape == (1, 100)
    assert mask[0].nonzero().flatten().tolist() == allowed
    assert expand_masks([bitmask([1, 70], 3)], 64, CPU)[0].nonzero().flatten().tolist() == [1]


def test_only_the_constrained_rows_are_masked_and_the_input_is_kept() -> None:
    """float32: rows 0 and 2 are constrained requests 7 and 9; row 1 (request 8) is free."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    masked = apply_token_masks(logits, [7, 8, 9], {7: bitmask([3], 2), 9: bitmask([10, 40], 2)})
    assert masked[0].isfinite().nonzero().flatten().tolist() == [3]
    assert masked[2].isfinite().nonzero().flatten().tolist() == [10, 40]
    assert torch.equal(masked[1], logits[1])
    assert torch.equal(masked[2, [10, 40]], logits[2, [10, 40]])
    assert logits.isfinite().all()
    # Greedy picks the best allowed token, however much likelier a refused one is.
    assert masked.argmax(-1)[0].item() == 3
    assert apply_token_masks(logits, [7, 8, 9], {}) is logits


def test_a_verified_runs_masks_split_into_its_rows() -> None:
    """A request verifying k proposals gets k + 1 masks sent as one: each row its own."""
    rows = [bytes([i]) * 8 for i in range(3)]
    assert split_masks(b"".join(rows), 3) == rows
    with pytest.raises(ValueError, match="do not split into 3 rows"):
        split_masks(b"x" * 10, 3)
