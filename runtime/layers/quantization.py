"""Opt-in int8 projections (`--quantization int8`): int8 weights x int8 activations, int32 sums.

Weights are quantized once at load, symmetric per output channel; activations are quantized on
the fly, symmetric per token (each row of the input gets its own scale), so a token's result does
not depend on what else is in the batch. The product runs as one integer GEMM (torch._int_mm,
oneDNN's s8 x s8 -> s32 kernel on the CPU), which on an AVX2 machine does about three times the
multiply-adds per second of the float32 GEMM, and reads a quarter of the weight bytes. The int32
sums are scaled back to float: y[t, n] = sum[t, n] * x_scale[t] * w_scale[n].

Embeddings, the LM head, norms, attention and the KV cache stay in the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

QUANTIZATION_METHODS = ("none", "int8")


@dataclass(frozen=True)
class Int8Weight:
    """A [out, in] weight as int8, stored transposed ([in, out], the layout the GEMM reads), with
    one float32 scale per output channel."""

    weight_t: torch.Tensor      # [in, out] int8
    scale: torch.Tensor         # [out] float32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.t().contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight_t.shape[1], self.weight_t.shape[0]))

    def dequantize(self) -> torch.Tensor:
        return (self.weight_t.t().float() * self.scale[:, None])


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] (float) @ weight^T; float result [..., out].

    Each token is quantized in two int8 parts: t = x / scale (scale: its largest |x| over 127),
    hi = round(t), and lo = round((t - hi) * 254), the rounding error at 1/254 of hi's step. Both
    go through one integer GEMM (stacked along the rows): out = (hi @ W + lo @ W / 254) * scale.
    One part alone keeps ~7 bits per activation; the two together leave the weights' rounding as
    the only error that matters, at twice the integer work, still well under float32's time."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    # A zero row gets a tiny scale and quantizes to zeros, so its result is exactly zero.
    x_scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp_min_(1e-12).div_(127.0)
    scaled = rows / x_scale
    hi = scaled.round()
    lo = scaled.sub_(hi).mul_(_LO_STEPS).round_()
    sums = torch._int_mm(torch.cat((hi, lo)).to(torch.int8), weight.weight_t)
    out = sums[n:].to(torch.float32).div_(_LO_STEPS).add_(sums[:n])
    out.mul_(x_scale).mul_(weight.scale)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


# hi's rounding error lies in [-0.5, 0.5]: times 254 it fills int8's [-127, 127].
_LO_STEPS = 254.0


def _swap(module: nn.Module, name: str, quantized: Int8Weight) -> None:
    # A registered parameter can only be replaced by another parameter: unregister it first.
    if name in module._parameters:
        del module._parameters[name]
    object.__setattr__(module, name, quantized)


def quantize_linear_weights(model: nn.Module, method: str) -> int:
    """Replace the decoder layers' projection weights (attention QKV and output, MLP gate/up and
    down) by their quantized form, in place. Returns the number of weights quantized.

    The LM head stays in float: with it quantized too, top-1 agreement with float32 on English
    text fell from ~98% to ~97% (bench/quant_quality.py), and its float GEMM runs only on the
    rows that sample."""
    if method == "none":
        return 0
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}: choose one of {QUANTIZATION_METHODS}")
    count = 0
    for layer in model.layers:
        for module, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            _swap(module, name, Int8Weight.quantize(getattr(module, name)))
            count += 1
    return count
