"""Opt-in int8 projections (`--quantization int8`): int8 weights x int8 activations, int32 sums.

Weights are quantized once at load, symmetric per output channel; activations are quantized on
the fly, symmetric per token (each row of the input gets its own scale), so a token's result does
not depend on what else is in the batch. The product runs as one integer GEMM (torch._int_mm,
oneDNN's s8 x s8 -> s32 kernel on the CPU), which on an AVX2 machine does about three times the
multiply-adds per second of the float32 GEMM, and reads a quarter of the weight bytes. The int32
sums are scaled back to float: y[t, n] = sum[t, n] * x_scale[t] * w_scale[n].

Embeddings, norms, attention and the KV cache stay in the model's dtype; the LM head's top
candidates are re-scored in it (RescoredInt8Head).

A GGUF file whose layers are blocks of 32 takes another way (int8_blocks.py): its blocks stay as
they are and its products quantize the activations to 8 bits per block of 32 instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers import cpu_ops
from spmd_runtime.runtime.layers.group_quant import GroupQuantWeight
from spmd_runtime.runtime.layers.int8_blocks import Int8BlocksHead, with_int8_activations
from torch import nn

QUANTIZATION_METHODS = ("none", "int8")


# oneDNN's u8 x s8 kernels sum pairs of products in int16 where the CPU has no int8 dot-product
# instruction (VNNI or AMX), saturating: on an AVX2-only CPU the prepacked sums were off by up to
# ~30,000 from torch._int_mm's exact ones. They are used only where they are exact.
_INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def _onednn_int8_ops() -> bool:
    onednn = getattr(torch.ops, "onednn", None)
    return (torch.backends.mkldnn.is_available() and onednn is not None
            and hasattr(onednn, "qlinear_prepack") and hasattr(onednn, "qlinear_pointwise")
            and any(flag in cpu_features.detect().flags for flag in _INT8_DOT_FLAGS))


_ONEDNN_INT8 = _onednn_int8_ops()


@dataclass(frozen=True)
class Int8Weight:
    """A [out, in] weight as int8 with one float32 scale per output channel, held once: plain,
    stored transposed ([in, out], the layout torch._int_mm reads, `weight_t`), or, where torch
    has oneDNN's exact int8 linear, prepacked for it instead (`packed`): the same integer sums,
    with the weight laid out once at load for the machine's int8 units rather than on every call
    (2x faster gate/up and LM head products on an AVX-512 VNNI/AMX VM, bench figures in
    docs/BENCHMARKS.md)."""

    weight_t: torch.Tensor | None           # [in, out] int8 (None when prepacked)
    scale: torch.Tensor                     # [out] float32
    packed: torch.Tensor | None = None      # oneDNN's prepacked [out, in]
    unit_scales: torch.Tensor | None = None  # [out] ones: scales are applied after the sums
    zero_points: torch.Tensor | None = None  # [out] zeros (symmetric weights)
    in_features: int = 0

    @classmethod
    def quantize(cls, weight: torch.Tensor, prepack: bool | None = None) -> Int8Weight:
        """`prepack`: hold the oneDNN form (default: where it is exact here, on the CPU)."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        if prepack is None:
            prepack = _ONEDNN_INT8 and q.device.type == "cpu"
        out_features, in_features = q.shape
        if not prepack:
            return cls(q.t().contiguous(), scale.contiguous(), in_features=in_features)
        return cls(None, scale.contiguous(), torch.ops.onednn.qlinear_prepack(q.contiguous(), None),
                   torch.ones(out_features), torch.zeros(out_features, dtype=torch.int64),
                   in_features)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scale.shape[0], self.in_features))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight_t, self.scale, self.packed) if t is not None]

    def integer_sums(self, parts: torch.Tensor) -> torch.Tensor:
        """sum_k part[r, k] * q[n, k] for integer-valued activation parts (float32 or int8): int32
        sums through torch._int_mm on the plain weight, or float32 ones holding the same integers
        through the prepacked weight (uint8 codes part + 128; oneDNN's zero point 128 takes the
        shift off)."""
        if self.packed is not None:
            codes = parts if parts.dtype == torch.uint8 else (parts.to(torch.int16) + 128).to(
                torch.uint8)
            return torch.ops.onednn.qlinear_pointwise(
                codes, 1.0, 128, self.packed, self.unit_scales, self.zero_points, None, 1.0, 0,
                torch.float32, "none", [], "")
        return torch._int_mm(parts.to(torch.int8), self.weight_t)

    def dequantize(self) -> torch.Tensor:
        """The float [out, in] weight the int8 values and scales stand for (the plain form's)."""
        if self.weight_t is None:
            raise ValueError("a prepacked Int8Weight keeps no plain int8 values to dequantize: "
                             "quantize with prepack=False")
        return (self.weight_t.t().float() * self.scale[:, None])


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] (float) @ weight^T; float result [..., out].

    Each token is quantized in two int8 parts: t = x / scale (scale: its largest |x| over 127),
    hi = round(t), and lo = round((t - hi) * 254), the rounding error at 1/254 of hi's step. Both
    go through one integer GEMM (stacked along the rows): out = (hi @ W + lo @ W / 254) * scale.
    One part alone keeps ~7 bits per activation; the two together leave the weights' rounding as
    the only error that matters, at twice the integer work, still well under float32's time."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype in _WIDENED and rows.device.type == "cpu" and cpu_ops.load():
        # The same arithmetic in two C++ passes instead of two chains of torch operators; bf16
        # rows are widened (exactly) first, as the torch chain widens them.
        parts, x_scale = torch.ops.spmd_cpu.quantize_rows_two_part(
            rows.float(), weight.packed is not None)
        out = torch.ops.spmd_cpu.dequantize_two_part(weight.integer_sums(parts), x_scale,
                                                     weight.scale)
        if bias is not None:
            out.add_(bias)
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    return int8_linear_reference(x, weight, bias)


_WIDENED = (torch.float32, torch.bfloat16)


def int8_linear_reference(x: torch.Tensor, weight: Int8Weight,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """int8_linear in torch operators: the path without the C++ operators, and their reference
    (both give the same bits)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    x_scale = token_scales(rows)
    scaled = rows / x_scale
    hi = scaled.round()
    lo = scaled.sub_(hi).mul_(_LO_STEPS).round_()
    sums = weight.integer_sums(torch.cat((hi, lo)))
    out = sums[n:].to(torch.float32).div_(_LO_STEPS).add_(sums[:n])
    out.mul_(x_scale).mul_(weight.scale)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def token_scales(rows: torch.Tensor) -> torch.Tensor:
    """[rows, 1] float32: each row's largest |x| over 127 (its int8 step). A zero row gets a tiny
    scale and quantizes to zeros, so its result is exactly zero."""
    return rows.abs().amax(dim=-1, keepdim=True).float().clamp_min_(1e-12).div_(127.0)


# hi's rounding error lies in [-0.5, 0.5]: times 254 it fills int8's [-127, 127].
_LO_STEPS = 254.0


@dataclass(frozen=True)
class RescoredInt8Head:
    """The LM head of an int8 model: every vocabulary logit from an int8 GEMM (weights per
    channel, activations per token in one part), then the `candidates` highest re-scored in
    float from the float table (the tied embedding, not a copy). The argmax, which greedy
    decoding takes, is the float head's whenever it ranks among the int8 candidates; sampling
    sees int8 logits outside them."""

    scores: Int8Weight
    weight: torch.Tensor            # [vocab, hidden] float
    candidates: int = 16

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def tensors(self) -> list[torch.Tensor]:
        return [*self.scores.tensors(), self.weight]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        x_scale = token_scales(rows)
        logits = self.scores.integer_sums(torch.round(rows / x_scale)).to(torch.float32)
        logits.mul_(x_scale).mul_(self.scores.scale)
        top = logits.topk(min(self.candidates, logits.shape[-1]), dim=-1).indices
        exact = torch.bmm(self.weight[top], rows.unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, top, exact.to(logits.dtype)).view(*hidden.shape[:-1], -1)


def swap_weight(module: nn.Module, name: str, replacement: object) -> None:
    """Put a packed or quantized form in place of a weight parameter (a registered parameter can
    only be replaced by another parameter: it is unregistered first)."""
    if name in module._parameters:
        del module._parameters[name]
    object.__setattr__(module, name, replacement)


def quantize_linear_weights(model: nn.Module, method: str) -> int:
    """Replace the decoder layers' projection weights (attention QKV and output, MLP gate/up and
    down) by their quantized form, and the LM head: a GGUF head of blocks of 32 by an
    Int8BlocksHead, or (without tensor parallelism, in a float32 model) a float head by a
    RescoredInt8Head, in place. Returns the number of weights quantized.

    The LM head is re-scored in float because quantized alone it cost a point of top-1
    agreement with float32 on English text (~98% -> ~97%, bench/quant_quality.py)."""
    if method == "none":
        return 0
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}: choose one of {QUANTIZATION_METHODS}")
    count = 0
    for module, name in model.projection_slots():
        weight = getattr(module, name)
        blocks = with_int8_activations(weight) if isinstance(weight, GroupQuantWeight) else None
        if isinstance(weight, GroupQuantWeight) and blocks is None:
            raise ValueError(f"--quantization int8 cannot multiply {name}'s GGUF blocks "
                             f"({', '.join(p.kind.name for p in weight.parts)}) by 8-bit "
                             "activations here: load the file dequantized (int8_keeps_blocks)")
        swap_weight(module, name, blocks or Int8Weight.quantize(weight))
        count += 1
    # A bfloat16 head keeps its table (the tied embedding: no bytes of its own) and runs on the
    # CPU's bfloat16 units; an int8 copy would add a byte per vocabulary weight for little. A
    # GGUF head of blocks of 32 keeps its blocks and takes 8-bit activations, its possible
    # argmaxes re-scored exactly (Int8BlocksHead: 8-bit logits alone cost ~0.3 points of top-1
    # agreement, bench/quant_quality.py); other GGUF heads keep their blocks' own products.
    head = Int8BlocksHead.of(model.lm_head) if isinstance(model.lm_head, GroupQuantWeight) \
        else None
    if head is not None:
        swap_weight(model, "lm_head", head)
        count += 1
    elif model.tp.size == 1 and isinstance(model.lm_head, torch.Tensor) and \
            model.lm_head.dtype == torch.float32:
        swap_weight(model, "lm_head", RescoredInt8Head(Int8Weight.quantize(model.lm_head),
                                                 model.lm_head.detach()))
        count += 1
    return count
