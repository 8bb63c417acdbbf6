"""bfloat16 projections held in the C++ library's own packed layout (cpu_bf16_panels.cpp): each
[out, in] weight packed once at load into panels of 32 output features, its bytes once (no
plain copy kept), multiplied by register tiles at every row count. On a CPU worker with
AVX512-BF16 and no AMX it replaces oneDNN's prepacked bf16 weight where it measured faster, on
inputs of up to PANELS_MAX_IN_FEATURES (SmolLM2's shapes on 2 Zen 5 cores: 0.69-0.96x
oneDNN's time at 1-32 rows, 0.98-1.02x at 512; bench/bf16_panels_ab.py, docs/BENCHMARKS.md),
and it takes the MLP's epilogues: SiLU x up in the gate/up product and the residual in the
down projection's, the same bits as the separate passes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers import cpu_ops

# oneDNN multiplies bf16 on AMX tiles where the CPU has them (16x AVX512-BF16's products a
# cycle): there its packed weights stay.
AMX = {"amx_bf16", "amx_tile"} <= cpu_features.detect().flags


# The widest inputs measured faster on the panels (bench/bf16_panels_ab.py, 2 Zen 5 cores):
# SmolLM2's 576 and 1536 at 0.69-0.95x oneDNN's time at 1-64 rows and 0.98-1.02x at 512, where
# Llama-3.2-1B's 2048 (a panel of 128 KiB, past L1) gained only at one row (0.85-1.00x) and
# took 1.02-1.08x at 16-512 rows, its 8192 (down projection) 1.18x at 16 rows.
PANELS_MAX_IN_FEATURES = 1536


@functools.cache
def _supported(in_features: int, out_features: int) -> bool:
    return cpu_ops.load() and bool(
        torch.ops.spmd_cpu.bf16_panels_supported(in_features, out_features))


def panels_take(weight: torch.Tensor, amx: bool | None = None) -> bool:
    """Whether this weight is held as panels: a 2-D bfloat16 CPU weight of a shape the library's
    build takes (AVX512-BF16; in and out features multiples of 32, at most
    PANELS_MAX_IN_FEATURES in), on a CPU without AMX (`amx`: default, this CPU's)."""
    return not (AMX if amx is None else amx) and weight.dtype == torch.bfloat16 and \
        weight.device.type == "cpu" and weight.dim() == 2 and \
        weight.shape[1] <= PANELS_MAX_IN_FEATURES and _supported(weight.shape[1], weight.shape[0])


@dataclass(frozen=True)
class PanelWeight:
    """A bfloat16 [out, in] weight packed into panels (int32 words, its bytes); `stand_in` is a
    zero-byte [out, in] bf16 view the operators read the shape from."""

    panels: torch.Tensor
    stand_in: torch.Tensor

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PanelWeight:
        weight = weight.detach()
        return cls(torch.ops.spmd_cpu.bf16_panels_pack(weight),
                   weight.new_zeros(1, 1).expand(weight.shape))

    @property
    def shape(self) -> torch.Size:
        return self.stand_in.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.panels]


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def panel_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias) -> [..., out], bfloat16."""
    out = torch.ops.spmd_cpu.bf16_panels_linear(_rows(x.to(torch.bfloat16)), weight.panels,
                                                weight.stand_in)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def panel_silu_product(rows: torch.Tensor, weight: object) -> torch.Tensor | None:
    """SiLU(rows @ gate^T) * (rows @ up^T) for a fused gate/up PanelWeight (gate rows first),
    SiLU x up in the tiles' epilogue: bit for bit silu_mul of the product. None for another
    weight or rows that are not 2-D bfloat16."""
    if not isinstance(weight, PanelWeight) or rows.dim() != 2 or rows.dtype != torch.bfloat16:
        return None
    return torch.ops.spmd_cpu.bf16_panels_silu_linear(_rows(rows), weight.panels, weight.stand_in)


def panel_residual_product(residual: torch.Tensor, x: torch.Tensor,
                           weight: object) -> torch.Tensor | None:
    """residual + x @ weight^T with the residual added in the tiles' epilogue (the same bits as
    the add), for a PanelWeight and bf16 residual rows of the product's shape; None otherwise."""
    if not isinstance(weight, PanelWeight) or x.dtype != torch.bfloat16 or \
            residual.dtype != torch.bfloat16 or \
            residual.shape != (*x.shape[:-1], weight.shape[0]):
        return None
    out = torch.ops.spmd_cpu.bf16_panels_residual_linear(
        _rows(x), weight.panels, weight.stand_in, _rows(residual))
    return out.view(residual.shape)
