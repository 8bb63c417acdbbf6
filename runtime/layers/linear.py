"""Dense projections y = x W^T + b.

On the CPU, oneDNN's linear primitive (the one torch.compile's CPU backend emits) is faster than
the default GEMM path for the shapes an LLM step has: 30-50% on decode-sized inputs (a few dozen
rows against a wide weight, and the vocabulary projection), 10-20% on prefill chunks. Where it
does not apply (another device, an unsupported dtype, a torch built without oneDNN) the plain
path runs; both compute the same product in float32 accumulation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from spmd_runtime.runtime.layers.quantization import Int8Weight, RescoredInt8Head, int8_linear

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_linear_op():
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_onednn_linear = _onednn_linear_op()
# oneDNN builds and caches a primitive for every input shape it meets (about 0.7 MB each, up to
# 1024 per cache), so a server whose steps carry ever new token counts grows by hundreds of MB.
# Inputs up to ONEDNN_EXACT_ROWS rows (decode batches) run as they are; longer ones are padded to
# a multiple of ONEDNN_ROW_MULTIPLE rows, so a worker meets a few dozen shapes per weight.
ONEDNN_EXACT_ROWS = 64
ONEDNN_ROW_MULTIPLE = 64


def _onednn_bounded_shapes(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = -(-rows // ONEDNN_ROW_MULTIPLE) * ONEDNN_ROW_MULTIPLE
    if rows <= ONEDNN_EXACT_ROWS or padded == rows or x.dim() != 2:
        return _onednn_linear(x, weight, bias, "none", [], "")
    staged = x.new_empty((padded, x.shape[1]))
    staged[:rows].copy_(x)
    staged[rows:].zero_()
    return _onednn_linear(staged, weight, bias, "none", [], "")[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight | RescoredInt8Head,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    if isinstance(weight, RescoredInt8Head):
        return weight.logits(x)
    # Under torch.compile the compiler picks its own GEMM (it cannot lower this op as called).
    if (_onednn_linear is not None and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES
            and not torch.compiler.is_compiling()):
        return _onednn_bounded_shapes(x, weight, bias)
    return F.linear(x, weight, bias)
