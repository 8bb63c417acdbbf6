"""The CPU dense projection (runtime/layers/linear.py): oneDNN with a bounded set of shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spmd_runtime.runtime.layers import linear as linear_mod
from spmd_runtime.runtime.layers.linear import ONEDNN_EXACT_ROWS, ONEDNN_ROW_MULTIPLE, linear


@pytest.mark.skipif(linear_mod._onednn_linear is None, reason="this torch has no oneDNN linear")
def test_onednn_meets_few_shapes_and_computes_the_same_product(monkeypatch) -> None:
    """Every row count gives F.linear's product; oneDNN sees row counts up to the decode bound
    exactly and longer inputs padded to a multiple, so its primitive caches stay small."""
    seen = []
    real = linear_mod._onednn_linear

    def recording(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(linear_mod, "_onednn_linear", recording)
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    for rows in (1, 7, ONEDNN_EXACT_ROWS, ONEDNN_EXACT_ROWS + 1, 100, 128, 129, 300, 1000):
        x = torch.randn(rows, 40)
        out = linear(x, weight, bias)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    long_inputs = [rows for rows in seen if rows > ONEDNN_EXACT_ROWS]
    assert long_inputs and all(rows % ONEDNN_ROW_MULTIPLE == 0 for rows in long_inputs), seen
