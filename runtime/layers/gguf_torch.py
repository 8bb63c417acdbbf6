"""GGUF block formats dequantized with torch tensor operations alone, on whatever device the blocks
are on: the non-CPU path of `--quantization gguf`.

On the CPU the C++ kernels (runtime/layers/cpu_group_quant.cpp) multiply the file's blocks
directly. On another device (CUDA) the blocks stay there, as the file stores them (uint8, one row
of blocks per output feature), and `dequantize` expands a projection's weight to float32 just
before its product, a projection at a time, so only one projection's float32 weight is held. There is
no numpy and no Python loop over blocks or rows here: every step is a whole-tensor view, slice,
shift, mask or multiply, so the same code runs on CPU, CUDA or any other torch device.

The formats (little-endian; a block of 32 weights, a K-quant super-block of 256 as 8 blocks):
Q4_0 w = d (q - 8); Q4_1 w = d q + m; Q5_0 w = d (q - 16); Q5_1 w = d q + m, the 5th bit of code
j being bit j of a 32-bit qh; Q8_0 w = d q, q int8; Q4_K and Q5_K w = (d sc) q - (dmin m) with
6-bit per-block scales sc and minima m packed in 12 bytes; Q6_K w = (d scale) (q - 32), int8
scales per 16 weights. The float32 operations are gguf's own (gguf.quants.dequantize), in its
order, so the results agree with it bit for bit. They would on any device even in another order
or fused: every product is exact in float32 (a float16 d of 11 significant bits times a scale
and a code of at most 12 between them, Q6_K's 7 + 5), so only the final add of a minimum rounds.
"""
from __future__ import annotations

from collections.abc import Callable

import gguf
import torch
from gguf import GGMLQuantizationType as GGML


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field at byte `offset` of each block, as float32 [N, blocks, 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _shifts(blocks: torch.Tensor, *amounts: int) -> torch.Tensor:
    """Shift amounts as a uint8 column [len(amounts), 1] on the blocks' device."""
    return torch.tensor(amounts, dtype=torch.uint8, device=blocks.device).view(-1, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Legacy 4-bit codes: qs [N, blocks, 16] -> [N, blocks, 32], the low nibbles of the 16
    bytes (weights 0-15) then their high nibbles (weights 16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """A little-endian 32-bit field qh [N, blocks, 4] as its bits [N, blocks, 32], bit j at j."""
    bits = (qh.unsqueeze(-1) >> _shifts(qh, *range(8)).t()) & 1
    return bits.reshape(*qh.shape[:-1], 32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    q = _nibbles(blocks[..., 2:18]).float() - 8
    return d * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[..., 4:20]).float()
    return d * q + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    q = _nibbles(blocks[..., 6:22]) | (_bits32(blocks[..., 2:6]) << 4)
    return d * (q.float() - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[..., 8:24]) | (_bits32(blocks[..., 4:8]) << 4)
    return d * q.float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    q = blocks[..., 2:34].view(torch.int8).float()
    return q * d


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's per-block scale and minimum, times d and dmin: float32 [N, blocks, 8, 1]
    each. Bytes 4-15 hold the 6-bit sc and m of the 8 blocks: blocks 0-3 in the low 6 bits of
    bytes 0-3 (sc) and 4-7 (m); blocks 4-5 in the nibbles of bytes 8-11 (sc low, m high) with
    their top 2 bits in the top bits of bytes 0-3 (sc) and 4-7 (m)."""
    scales = blocks[..., 4:16].unflatten(-1, (3, 4))
    low, mid, high = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
    sc = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], dim=-1)
    m = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    d = _half(blocks, 0) * sc.float()
    dm = _half(blocks, 2) * m.float()
    return d.unsqueeze(-1), dm.unsqueeze(-1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's 4-bit codes qs [N, blocks, 128] -> [N, blocks, 8, 32]: block b takes
    the 32 bytes from 32 (b // 2), their low nibbles for even b, high for odd."""
    pairs = qs.unflatten(-1, (4, 1, 32)) >> _shifts(qs, 0, 4)
    return (pairs & 0x0F).flatten(-3, -2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(blocks)
    q = _k_nibbles(blocks[..., 16:144]).float()
    return (d * q - dm).flatten(-2)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(blocks)
    qh = blocks[..., 16:48]
    high = (qh.unsqueeze(-2) >> _shifts(qh, *range(8))) & 1
    q = (_k_nibbles(blocks[..., 48:176]) | (high << 4)).float()
    return (d * q - dm).flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Block b (h = b // 4, part = b % 4): low 4 bits from ql[64 h + 32 (part % 2) + j] shifted
    4 (part // 2), high 2 bits from qh[32 h + j] shifted 2 part; int8 scales per 16 weights."""
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    low = ((ql.unflatten(-1, (2, 1, 64)) >> _shifts(ql, 0, 4)) & 0x0F).reshape(*ql.shape[:-1], 2, 4, 32)
    high = (qh.unflatten(-1, (2, 1, 32)) >> _shifts(qh, 0, 2, 4, 6)) & 0x03
    q = ((low | (high << 4)).float() - 32).reshape(*ql.shape[:-1], 16, 16)
    scales = blocks[..., 192:208].view(torch.int8).float()
    d = (_half(blocks, 208) * scales).unsqueeze(-1)
    return (d * q).flatten(-2)


# Each supported type's expansion: uint8 blocks [N, blocks, bytes a block] -> float32
# [N, blocks, weights a block] (or [N, blocks, ..., weights], flattened by the caller).
_EXPANSIONS: dict[GGML, Callable[[torch.Tensor], torch.Tensor]] = {
    GGML.Q4_0: _q4_0, GGML.Q4_1: _q4_1, GGML.Q5_0: _q5_0, GGML.Q5_1: _q5_1, GGML.Q8_0: _q8_0,
    GGML.Q4_K: _q4_k, GGML.Q5_K: _q5_k, GGML.Q6_K: _q6_k,
}
SUPPORTED_TYPES = tuple(_EXPANSIONS)


def dequantize(data: torch.Tensor, kind: GGML, in_features: int) -> torch.Tensor:
    """data: uint8 [N, bytes a row] (each output feature's row of blocks, exactly as the GGUF
    file stores it), kind a gguf.GGMLQuantizationType among Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    Q5_K, Q6_K -> float32 [N, in_features] on data's device: gguf's own dequantisation."""
    expansion = _EXPANSIONS.get(kind)
    if expansion is None:
        name = getattr(kind, "name", str(kind))
        raise ValueError(f"GGML type {name} cannot be dequantized on the device; supported: "
                         + ", ".join(t.name for t in SUPPORTED_TYPES))
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"{kind.name} blocks must be uint8 [rows, bytes a row], got "
                         f"{data.dtype} {tuple(data.shape)}")
    per_block, size = gguf.GGML_QUANT_SIZES[kind]
    if in_features % per_block:
        raise ValueError(f"{kind.name} holds blocks of {per_block} weights; {in_features} "
                         "in_features does not split into them")
    count = in_features // per_block
    if data.shape[1] != count * size:
        raise ValueError(f"{kind.name} rows of {in_features} weights take {count * size} bytes "
                         f"({count} blocks of {size}), got {data.shape[1]}")
    blocks = data.reshape(data.shape[0], count, size)
    return expansion(blocks).reshape(data.shape[0], in_features)
