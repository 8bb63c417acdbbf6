"""Dense projections y = x W^T + b.

On an Intel CPU worker with MKL, float32 weights are packed once at load into MKL's GEMM layout
(PackedWeight): on a 2-core AVX-512 VM that runs the decode-sized products 1.5-1.7x faster than
oneDNN (64 rows: 330-420 GFLOP/s against 215-300), 2-4x at one row, and prefill chunks ~10%
faster, in the same float32 arithmetic. On other CPUs MKL's sgemm was the slower one (2-3.3x
oneDNN's time on an AMD Zen 5 VM), so float32 weights are packed for oneDNN there. bfloat16
weights are packed once at load: on a CPU with AVX512-BF16 and no AMX into the C++ library's
panels (bf16_panels.py PanelWeight: its own tiles at every row count, 0.69-0.96x oneDNN's time
at 1-32 rows on SmolLM2's shapes), elsewhere into oneDNN's layout for its linear primitive
where oneDNN computes bf16 (PackedWeight too): the same bits as on the plain weight, which
oneDNN would otherwise reorder on every call (on a 2-core AVX512-BF16 VM 1.3-1.8x faster at 1-32
rows, docs/BENCHMARKS.md). A plain bf16 weight (a tied LM head, which stays the embedding table)
meets decode-sized inputs on the C++ library's AVX512-BF16 tiles where they run
(plain_bf16.py). Otherwise (a torch without MKL, compiled layers, longer inputs on a plain
bf16 weight) oneDNN's linear primitive on the plain weight, the one
torch.compile's CPU backend emits, which beats the default GEMM path on an LLM's shapes;
elsewhere (another device) the plain path. All compute the same product in float32
accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers.bf16_panels import PanelWeight, panel_linear, panels_take
from spmd_runtime.runtime.layers.group_quant import (
    GroupQuantWeight,
    decode_layers_blocks,
    group_quant_linear,
)
from spmd_runtime.runtime.layers.int8_blocks import Int8BlocksHead
from spmd_runtime.runtime.layers.plain_bf16 import plain_bf16_linear
from spmd_runtime.runtime.layers.quantization import (
    Int8Weight,
    RescoredInt8Head,
    int8_linear,
    swap_weight,
)
from torch import nn


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """float32, and bfloat16 where oneDNN computes it on this CPU (AVX-512 and up): on an AVX2
    CPU it has no bfloat16 inner product and refuses to build one; torch's own GEMM runs it."""
    if not torch.backends.mkldnn.is_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32, torch.bfloat16
    return (torch.float32,)


_ONEDNN_DTYPES = _onednn_dtypes()


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


# The hint MKL packs for (the rows it expects): one packed weight serves any row count when each
# call names its own, and 256 measured best across decode batches and prefill chunks.
PACK_ROWS_HINT = 256


def _mkl_packed_linear_op():
    if not torch.backends.mkl.is_available():
        return None
    return getattr(torch.ops.mkl, "_mkl_linear", None)


_mkl_packed_linear = _mkl_packed_linear_op()
# MKL's packed sgemm is the faster float32 GEMM on Intel CPUs; on others (an AMD Zen 5 VM) it
# took 2-3.3x oneDNN's time on the same packed shapes, so float32 weights are packed for oneDNN
# there, as bf16 ones are everywhere (docs/BENCHMARKS.md).
MKL_FLOAT32 = cpu_features.detect().vendor == "GenuineIntel"


@dataclass(frozen=True)
class PackedWeight:
    """A float32 [out, in] weight in MKL's packed GEMM layout (2-4x the weight's bytes), or a
    float32 or bfloat16 one in oneDNN's blocked layout (its bytes); the plain weight can be
    dropped.
    `stand_in` is a zero-byte [out, in] view in the weight's dtype: the operators read only the
    weight's shape from it."""

    packed: torch.Tensor
    stand_in: torch.Tensor
    onednn: bool = False            # oneDNN's layout (else MKL's)

    @classmethod
    def pack(cls, weight: torch.Tensor, mkl: bool | None = None) -> PackedWeight:
        """`mkl`: MKL's layout for a float32 weight (default: on Intel CPUs, MKL_FLOAT32)."""
        weight = weight.detach().contiguous()
        stand_in = weight.new_zeros(1, 1).expand(weight.shape)
        if weight.dtype == torch.float32 and (MKL_FLOAT32 if mkl is None else mkl):
            return cls(torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS_HINT), stand_in)
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT), stand_in, True)

    @property
    def shape(self) -> torch.Size:
        return self.stand_in.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.onednn:
        return _onednn_bounded_shapes(x, weight.packed, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = _mkl_packed_linear(rows, weight.packed, weight.stand_in, bias, rows.shape[0])
    return out.view(*x.shape[:-1], out.shape[-1])


def decode_layers_slots(weight: object, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A projection's (packed, stand-in) pair for spmd_cpu::decode_layers at `rows` rows: MKL's
    or oneDNN's packed form, a plain bfloat16 weight in both places, or a GGUF weight's blocks
    and their type; None for any other form."""
    if isinstance(weight, PackedWeight):
        return weight.packed, weight.stand_in
    if isinstance(weight, PanelWeight):
        return weight.panels, weight.stand_in
    if isinstance(weight, GroupQuantWeight):
        return decode_layers_blocks(weight, rows)
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16:
        return weight, weight
    return None


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` on this device can be packed: float32 for MKL (Intel) or
    oneDNN, bfloat16 for oneDNN where it computes bf16 (which every CPU with the panels' tiles
    does: pack_linear_weights then picks the panels per weight)."""
    if device.type != "cpu":
        return False
    onednn = dtype in _ONEDNN_DTYPES and _onednn_linear is not None and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")
    if dtype == torch.bfloat16:
        return onednn
    return dtype == torch.float32 and (_mkl_packed_linear is not None if MKL_FLOAT32 else onednn)


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every projection of the model (the layers' and the LM head) in place, except those
    kept in GGUF's blocks (--quantization gguf) and a bfloat16 head tied to the embedding table:
    packing it would add a copy of the table (a fifth of a Llama-3.2-1B's parameters), where a
    float32 model's packed forms are copies anyway. Returns the number packed."""
    count = 0
    for module, name in [*model.projection_slots(), (model, "lm_head")]:
        weight = getattr(module, name)
        tied = module is model and name == "lm_head" and weight is model.embed_tokens
        if isinstance(weight, torch.Tensor) and not (tied and weight.dtype == torch.bfloat16):
            swap_weight(module, name, PanelWeight.pack(weight) if panels_take(weight)
                        else PackedWeight.pack(weight))
            count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: its parameters and its packed or quantized forms,
    each storage counted once (a tied table too)."""
    tensors = list(model.parameters())
    for module in model.modules():
        tensors += [t for value in vars(module).values()
                    if isinstance(value, PackedWeight | PanelWeight | Int8Weight | RescoredInt8Head
                                  | GroupQuantWeight | Int8BlocksHead)
                    for t in value.tensors()]
    return sum(t.numel() * t.element_size()
               for t in {_storage_key(t): t for t in tensors}.values())


def weight_parameters(model: nn.Module) -> int:
    """Parameters of the model's weights, each once (a tied table counts once), whatever form
    holds them: what weight_bytes' bytes per parameter are taken over."""
    weights: dict[int, object] = {}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for module in model.modules():
        for name, value in [*module._parameters.items(), *vars(module).items()]:
            if tied and module is model and name == "lm_head":    # the embedding's parameters
                continue
            if isinstance(value, torch.Tensor | PackedWeight | PanelWeight | Int8Weight
                          | GroupQuantWeight | Int8BlocksHead):
                key = _storage_key(value) if isinstance(value, torch.Tensor) else id(value)
                weights[key] = value
    return sum(w.numel() if isinstance(w, torch.Tensor) else w.shape.numel()
               for w in weights.values())


def _storage_key(tensor: torch.Tensor) -> int:
    # MKL's packed weights are opaque tensors without a storage to look at: each is its own.
    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and \
            not tensor.is_mkldnn and tensor.numel():
        try:
            return tensor.untyped_storage().data_ptr()
        except NotImplementedError:
            pass
    return id(tensor)


def logits_linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight | PanelWeight |
                  Int8Weight | RescoredInt8Head | GroupQuantWeight | Int8BlocksHead
                  ) -> torch.Tensor:
    """The LM head's product: `linear`, but GGUF blocks give float32 logits whatever x's
    dtype. Rounded to bf16, logits of ~10-20 are 1/16-1/8 apart, so near-equal ones tie: int8
    over bf16 agreed with float32's top-1 on 96.54% of 24,434 positions, 97.39% with the bf16
    product's float32 sums kept (bench/quant_quality.py)."""
    if isinstance(weight, GroupQuantWeight):
        return group_quant_linear(x, weight, None, float32_out=True)
    if isinstance(weight, Int8BlocksHead):
        return weight.logits(x)
    return linear(x, weight)


def linear(x: torch.Tensor,
           weight: torch.Tensor | PackedWeight | PanelWeight | Int8Weight | RescoredInt8Head
           | GroupQuantWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, PanelWeight):
        return panel_linear(x, weight, bias)
    if isinstance(weight, PackedWeight):
        return packed_linear(x, weight, bias)
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    if isinstance(weight, RescoredInt8Head):
        return weight.logits(x)
    if isinstance(weight, GroupQuantWeight):
        return group_quant_linear(x, weight, bias)
    tiled = plain_bf16_linear(x.reshape(-1, x.shape[-1]), weight)
    if tiled is not None:
        out = tiled if bias is None else tiled + bias
        return out.view(*x.shape[:-1], out.shape[-1])
    # Under torch.compile the compiler picks its own GEMM (it cannot lower this op as called).
    if (_onednn_linear is not None and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES
            and not torch.compiler.is_compiling()):
        return _onednn_bounded_shapes(x, weight, bias)
    return F.linear(x, weight, bias)
