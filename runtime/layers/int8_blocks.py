"""`--quantization int8` over a GGUF file of blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the
file's blocks kept as they are, the activations quantized to 8 bits per block of 32 (step
max |x| / 127, as llama.cpp's Q8 activations) and multiplied by the blocks' codes in integers
(spmd_cpu::gguf_int8_linear, runtime/layers/cpu_group_quant_int8.h). A GroupQuantWeight marked
`int8_activations` takes these products at takes_int8's row counts and the blocks' own at the
others; a file with other types (the K-quants) keeps the per-channel int8 path of
quantization.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.runtime.layers import cpu_ops


class BlockParts(Protocol):
    """What these products read of a group_quant.GroupQuantWeight (imported by it, not here)."""

    parts: tuple
    in_features: int
    int8_activations: bool


Weight = TypeVar("Weight", bound=BlockParts)

# Block types whose products take 8-bit activations under `--quantization int8` (blocks of 32;
# the K-quants' super-blocks keep their own products).
INT8_BLOCK_TYPES = (GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0)


def int8_blocks_supported() -> bool:
    """Whether the C++ library here multiplies 8-bit activations by blocks (AVX-512 BW, VNNI)."""
    return cpu_ops.load() and torch.ops.spmd_cpu.gguf_int8_linear_supported()


def with_int8_activations(weight: Weight) -> Weight | None:
    """The weight whose products take 8-bit activations (`--quantization int8` over a GGUF
    file: the blocks are the file's, unchanged), or None where a part's type is not a block of
    32, the blocks are not on the CPU or the library cannot multiply them."""
    if not all(p.kind in INT8_BLOCK_TYPES and p.data.device.type == "cpu" for p in weight.parts):
        return None
    return replace(weight, int8_activations=True) if int8_blocks_supported() else None


def int8_keeps_blocks(layer_types: list[str]) -> bool:
    """Whether `--quantization int8` over a GGUF file whose layers are in `layer_types` (by
    name) keeps the file's blocks and multiplies them by 8-bit activations: every type a block
    of 32, and the library able to; otherwise the file is dequantized and its projections
    quantized per output channel (Int8Weight)."""
    return bool(layer_types) and all(GGML[name] in INT8_BLOCK_TYPES for name in layer_types) \
        and int8_blocks_supported()


# An int8 weight's products take 8-bit activations at every row count. Measured on SmolLM2's
# four projections of 30 layers (weights from memory, 2 Zen 5 cores, us a layer, the blocks'
# own products against the 8-bit ones): bf16 rows 151 / 98 at 1 row, 196 / 115 at 8, 350 / 254
# at 32, 502 / 312 at 40, 660 / 476 at 64; float32 rows 139 / 85 at 1, 381 / 125 at 8. (The
# blocks' own products took the row counts below 16, and bf16 rows 33-48, until the int8 panels
# fetched their next panel ahead.)
INT8_FROM_ROWS = 1


def takes_int8(weight: BlockParts, rows: int) -> bool:
    """Whether an int8 weight's product of `rows` rows (float32 or bf16) takes 8-bit
    activations: every row count from INT8_FROM_ROWS."""
    return weight.int8_activations and rows >= INT8_FROM_ROWS


def _one_int8_part(rows: torch.Tensor, weight: object):
    """The one part of a weight whose product with these 2-D CPU rows takes 8-bit activations,
    or None."""
    if not getattr(weight, "int8_activations", False) or len(weight.parts) != 1 or \
            rows.dim() != 2 or rows.device.type != "cpu" or \
            not takes_int8(weight, rows.shape[0]):
        return None
    return weight.parts[0]


# From this many rows a fused gate/up projection on 8-bit activations runs SiLU x up after its
# panels (gguf_int8_silu_linear, the same bits as silu_mul after the product), so the [rows, 2 x
# intermediate] product is never written. Measured alone on 2 Zen 5 cores (SmolLM2's gate/up,
# 30 layers from memory, us): fewer rows the fused form is slower (1 row 42 against 32-35, 8
# rows 71 against 59), at 16-32 rows the two are equal, and at 64 rows and 1,024 as well
# (189-196 against 188-218 us, 2.8-2.9 against 2.8-3.4 ms).
INT8_GATED_FROM_ROWS = 33   # cpu_layer_stack.h kInt8GatedFromRows mirrors it


def int8_silu_product(rows: torch.Tensor, weight: object) -> torch.Tensor | None:
    """SiLU(rows @ gate^T) * (rows @ up^T) for a fused gate/up projection (gate rows first) of
    one block type on 8-bit activations, from INT8_GATED_FROM_ROWS rows, in one product that
    finishes each task's outputs (spmd_cpu::gguf_int8_silu_linear); None for anything else (the
    caller multiplies, then silu_mul)."""
    part = _one_int8_part(rows, weight)
    if part is None or rows.shape[0] < INT8_GATED_FROM_ROWS or part.data.shape[0] % 32:
        return None
    return torch.ops.spmd_cpu.gguf_int8_silu_linear(rows.contiguous(), part.data, int(part.kind),
                                                    weight.in_features)


def int8_residual_product(residual: torch.Tensor, rows: torch.Tensor,
                          weight: object) -> torch.Tensor | None:
    """residual + rows @ weight^T for a weight of one block type on 8-bit activations, the
    residual (in rows' dtype and the product's shape) added in the product's epilogue
    (spmd_cpu::gguf_int8_residual_linear, the same bits as the add); None for anything else."""
    part = _one_int8_part(rows, weight)
    if part is None or residual.dtype != rows.dtype or \
            residual.shape != (rows.shape[0], part.data.shape[0]):
        return None
    return torch.ops.spmd_cpu.gguf_int8_residual_linear(
        rows.contiguous(), part.data, int(part.kind), weight.in_features, residual.contiguous())


def int8_product(rows: torch.Tensor, weight: BlockParts,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, in] (float32 or bf16) @ weight^T (+ bias) in rows' dtype: each row quantized to
    int8 per block of 32 (step max |x| / 127), times the blocks' codes in integers, scaled back
    in float32 (spmd_cpu::gguf_int8_linear; a part at a time for a stacked weight)."""
    rows = rows.contiguous()
    outs = [torch.ops.spmd_cpu.gguf_int8_linear(rows, p.data, int(p.kind), weight.in_features)
            for p in weight.parts]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out if bias is None else out + bias


@dataclass(frozen=True)
class Int8BlocksHead:
    """The LM head of `--quantization int8` over a GGUF file (its table of blocks of 32, often
    the tied embedding's, not a copy): every logit from 8-bit activations times the blocks'
    codes, then every logit that a bound of the 8-bit error cannot rule out of its row's
    largest re-scored exactly (spmd_cpu::gguf_int8_head, runtime/layers/cpu_int8_head.h). The
    greedy token, the first index of a row's largest logit, is the exact product's; sampling and
    log-probabilities see 8-bit logits outside the few re-scored. `bounds` is that bound's
    table (float32 [vocab x (in / 32 + 1)]: 4 bytes per 32 weights), made once at load."""

    weight: BlockParts
    bounds: torch.Tensor

    @classmethod
    def of(cls, weight: object) -> Int8BlocksHead | None:
        """The head over these blocks, or None where they are not one part of a type of blocks
        of 32 on the CPU, or the library cannot multiply them by 8-bit activations."""
        parts = getattr(weight, "parts", ())
        if len(parts) != 1 or with_int8_activations(weight) is None:
            return None
        part = parts[0]
        return cls(weight, torch.ops.spmd_cpu.gguf_int8_head_bounds(part.data, int(part.kind),
                                                                    weight.in_features))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def tensors(self) -> list[torch.Tensor]:
        return [*self.weight.tensors(), self.bounds]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., vocab] for hidden [..., in] (float32 or bf16)."""
        out = self._run(torch.ops.spmd_cpu.gguf_int8_head, hidden)
        return out.view(*hidden.shape[:-1], out.shape[-1])

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: the first index of each row's largest logit (the exact product's, as
        `logits` would give it), the logits never written (spmd_cpu::gguf_int8_greedy_head:
        2.0 against the bf16 head's 2.6 ms at 32 SmolLM2 rows, 3.5 against 5.5 at 64)."""
        return self._run(torch.ops.spmd_cpu.gguf_int8_greedy_head, hidden)

    def _run(self, op, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.dtype not in (torch.float32, torch.bfloat16):
            rows = rows.float()
        part = self.weight.parts[0]
        return op(rows.contiguous(), part.data, int(part.kind), self.weight.in_features,
                  self.bounds)
