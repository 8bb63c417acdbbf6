"""GGUF's quantized weights kept quantized (`--quantization gguf`): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
and the K-quants Q4_K, Q5_K and Q6_K.

Each of these formats cuts a weight row into blocks and stores per block a scale and the codes:
Q4_0 and Q4_1 blocks of 32 with a float16 d (Q4_1 also a minimum m), 4-bit codes q in [0, 15],
w = d (q - 8) or d q + m; Q8_0 8-bit signed codes, w = d q. The K-quants group 8 blocks of 32
(Q6_K: 16 of 16) in super-blocks of 256 with float16 d (and dmin) and 6- or 8-bit per-block
scales (and minimums). A GroupQuantWeight holds per block float32 `scales` and, where the format
has one, `offsets`, w = scale * q + offset, and the codes: 4-bit ones two to a byte (Q4_0, Q4_1
as the file has them; Q4_K re-laid in that order), 5- and 6-bit ones in a byte each. That is
0.75 bytes per weight for 4-bit blocks, 1.125 for Q8_0, 1.25 for Q5_K and Q6_K, against 4 in
float32. Nothing is expanded at load: a block's weights are made, in float32, only where a
product needs them (runtime/layers/cpu_group_quant.cpp; the torch reference here where the C++
library is not built).

The expanded weights equal gguf's own dequantisation bit for bit (the same float32 products and
sums), so the only difference from `--quantization none` is the order of the products' sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.runtime.layers import cpu_ops

BLOCK = 32
# The block formats kept quantized, with the bits of the codes they are held in.
KEPT_TYPES = {GGML.Q4_0: 4, GGML.Q4_1: 4, GGML.Q5_0: 8, GGML.Q5_1: 8, GGML.Q8_0: 8, GGML.Q4_K: 4,
              GGML.Q5_K: 8, GGML.Q6_K: 8}


@dataclass(frozen=True)
class GroupQuantWeight:
    """A [out, in] weight in blocks of `block` weights along its rows (32; Q6_K's 16): codes,
    and per block a scale and, where the format has one, an offset. `dtype` is the dtype its
    products are returned in."""

    codes: torch.Tensor             # uint8 [out, in / 2] (4-bit) or int8 [out, in] (8-bit)
    scales: torch.Tensor            # float32 [out, in / block]
    offsets: torch.Tensor | None    # float32 [out, in / block], or None (w = scale * q)
    bits: int
    dtype: torch.dtype = torch.float32
    block: int = BLOCK

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.scales.shape[1] * self.block))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.offsets) if t is not None]

    def __getitem__(self, index) -> GroupQuantWeight | torch.Tensor:
        """Rows (`w[a:b]`, `w[rows]`) or columns (`w[:, a:b]`): the slices a checkpoint's shards
        and stacked parts take. Columns that split blocks (a row-parallel shard of a model whose
        width per rank is not a multiple of 32) come expanded, in `dtype`."""
        if not isinstance(index, tuple):
            return self._map(lambda t: t[index])
        rows, columns = index
        start, stop, step = columns.indices(self.shape[1])
        if step != 1 or start % BLOCK or stop % BLOCK:
            return self.expand()[rows, columns].to(self.dtype)
        blocks = slice(start // self.block, stop // self.block)
        code_bytes = slice(start * self.bits // 8, stop * self.bits // 8)
        return GroupQuantWeight(self.codes[rows, code_bytes], self.scales[rows, blocks],
                                None if self.offsets is None else self.offsets[rows, blocks],
                                self.bits, self.dtype, self.block)

    def _map(self, fn) -> GroupQuantWeight:
        """The same weight with `fn` applied to each of its tensors (rows kept aligned)."""
        return GroupQuantWeight(fn(self.codes), fn(self.scales),
                                None if self.offsets is None else fn(self.offsets),
                                self.bits, self.dtype, self.block)

    def pad_rows(self, count: int) -> GroupQuantWeight:
        """`count` rows, the ones past its own all zero (a vocabulary's last shard)."""
        def padded(tensor: torch.Tensor) -> torch.Tensor:
            pad = tensor.new_zeros((count - tensor.shape[0], *tensor.shape[1:]))
            return torch.cat([tensor, pad])

        return self._map(padded)

    def widened(self, block: int, offsets: bool) -> GroupQuantWeight:
        """The same weights as 8-bit codes in blocks of `block` (a divisor of its own), with
        offsets (zeros where it had none) if asked: a layout that stacks with wider parts.
        Expands to the same values (q * scale, plus 0 where there was no offset)."""
        codes = _one_per_weight(self.codes).view(torch.int8) if self.bits == 4 else self.codes
        repeat = self.block // block
        scales = self.scales.repeat_interleave(repeat, dim=1)
        shifts = self.offsets
        if shifts is None and offsets:
            shifts = torch.zeros_like(self.scales)
        if shifts is not None:
            shifts = shifts.repeat_interleave(repeat, dim=1)
        return GroupQuantWeight(codes.contiguous(), scales, shifts, 8, self.dtype, block)

    def contiguous(self) -> GroupQuantWeight:
        return self._map(lambda t: t.contiguous())

    @staticmethod
    def cat_rows(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
        """Weights stacked along their rows (a fused QKV or gate/up projection)."""
        first = parts[0]
        if any((p.bits, p.block, p.offsets is None, p.shape[1]) != (
                first.bits, first.block, first.offsets is None, first.shape[1]) for p in parts):
            raise ValueError("only weights of one block layout and width stack")
        return GroupQuantWeight(torch.cat([p.codes for p in parts]),
                                torch.cat([p.scales for p in parts]),
                                None if first.offsets is None
                                else torch.cat([p.offsets for p in parts]), first.bits,
                                first.dtype, first.block)

    def expand(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights (or those of `rows`) as float32 [.., in]: scale * q + offset."""
        codes, scales, offsets = (self.codes, self.scales, self.offsets) if rows is None else (
            self.codes[rows], self.scales[rows], None if self.offsets is None else self.offsets[rows])
        if self.bits == 4:
            codes = _one_per_weight(codes)
        q = codes.view(*codes.shape[:-1], -1, self.block).float()
        w = q * scales.unsqueeze(-1)
        if offsets is not None:
            w = w + offsets.unsqueeze(-1)
        return w.view(*codes.shape[:-1], -1)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (a token embedding lookup), in `dtype`."""
        return self.expand(ids).to(self.dtype)


def _one_per_weight(nibbles: torch.Tensor) -> torch.Tensor:
    """4-bit codes [.., in / 2], two to a byte in blocks of 32 (byte j: weight j low, j + 16
    high), as one uint8 code per weight [.., in]."""
    pairs = nibbles.view(*nibbles.shape[:-1], -1, BLOCK // 2)
    return torch.cat((pairs & 0x0F, pairs >> 4), dim=-1).view(*nibbles.shape[:-1], -1)


def stack_rows(parts: list) -> torch.Tensor | GroupQuantWeight:
    """Weights stacked along their rows (a fused QKV or gate/up projection): still in blocks
    where every part is, parts of different layouts (Q4_K_M's Q4_K queries beside Q6_K values)
    widened to one (GroupQuantWeight.widened); expanded where a part is a plain tensor (a type
    not kept)."""
    if all(isinstance(part, GroupQuantWeight) for part in parts):
        layouts = {(p.bits, p.block, p.offsets is None) for p in parts}
        if len(layouts) > 1:
            block = min(p.block for p in parts)
            parts = [p.widened(block, any(q.offsets is not None for q in parts)) for p in parts]
        return GroupQuantWeight.cat_rows(parts)
    dtype = parts[0].dtype
    return torch.cat([part.expand().to(dtype) if isinstance(part, GroupQuantWeight) else part
                      for part in parts])


def assign_weight(module: torch.nn.Module, name: str,
                  value: torch.Tensor | GroupQuantWeight) -> None:
    """A loaded weight into `module.name`: copied into its parameter, or (kept in blocks) put in
    the parameter's place."""
    if isinstance(value, GroupQuantWeight):
        if name in module._parameters:
            del module._parameters[name]
        object.__setattr__(module, name, value.contiguous())    # a column shard is not
    else:
        getattr(module, name).copy_(value)


def group_quant_linear(x: torch.Tensor, weight: GroupQuantWeight,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias), in x's dtype; the products in float32."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if rows.device.type == "cpu" and cpu_ops.load():
        out = torch.ops.spmd_cpu.group_quant_linear(rows, weight.codes, weight.scales,
                                                    weight.offsets, weight.bits, weight.block)
    else:
        out = F.linear(rows, weight.expand())
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def from_gguf_blocks(raw: np.ndarray, tensor_type: GGML, shape: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> GroupQuantWeight:
    """A GGUF tensor's bytes (`shape` = [out, in], Hugging Face's order) as a GroupQuantWeight,
    read without expanding a weight."""
    bits = KEPT_TYPES[tensor_type]
    out_features, in_features = shape
    if in_features % BLOCK:
        raise ValueError(f"a {tensor_type.name} tensor of shape {shape} does not split into "
                         f"blocks of {BLOCK}")
    if tensor_type in _K_QUANTS:
        return _K_QUANTS[tensor_type](raw, shape, dtype)
    if tensor_type in (GGML.Q5_0, GGML.Q5_1):
        return _from_q5(raw, shape, dtype, with_min=tensor_type == GGML.Q5_1)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(out_features, in_features // BLOCK, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor_type == GGML.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        codes, offsets = blocks[..., 4:], m
    elif tensor_type == GGML.Q4_0:
        codes, offsets = blocks[..., 2:], -8.0 * d
    else:
        codes, offsets = blocks[..., 2:].view(np.int8), None
    return GroupQuantWeight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(out_features, -1)),
        torch.from_numpy(d), None if offsets is None else torch.from_numpy(offsets),
        bits, dtype)


def _from_q5(raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype,
             with_min: bool) -> GroupQuantWeight:
    """Q5_0 and Q5_1 (most of a Q4_K_M file of a model whose width is not a multiple of 256):
    blocks of 32 with a float16 d (Q5_1: and m), a 32-bit word of fifth bits (bit j: weight j)
    and 16 bytes of low nibbles (byte j: weight j, and j + 16 in its high nibble); w = d (q - 16)
    or d q + m. Held as 8-bit codes (q - 16, or q) with scale d and offset m."""
    out_features, in_features = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(out_features, in_features // BLOCK, -1)
    d = _halves(blocks[..., 0:2])[..., 0]
    at = 4 if with_min else 2
    high = blocks[..., at:at + 4].copy().view("<u4")
    high = (high >> np.arange(BLOCK, dtype=np.uint32)) & 1
    low = blocks[..., at + 4:].reshape(out_features, -1, 1, BLOCK // 2) >> np.array(
        [0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (low & 0x0F).reshape(out_features, -1, BLOCK) | (high.astype(np.uint8) << 4)
    codes = q.astype(np.int8) - np.int8(0 if with_min else 16)
    offsets = _halves(blocks[..., 2:4])[..., 0] if with_min else None
    return _weight(codes.reshape(out_features, -1), d, offsets, 8, dtype)


def _super_blocks(raw: np.ndarray, shape: tuple[int, int], name: str) -> np.ndarray:
    """A K-quant tensor's bytes as [out, in / 256, bytes per super-block of 256 weights]."""
    out_features, in_features = shape
    if in_features % 256:
        raise ValueError(f"a {name} tensor of shape {shape} does not split into blocks of 256")
    return np.ascontiguousarray(raw).view(np.uint8).reshape(out_features, in_features // 256, -1)


def _halves(field: np.ndarray) -> np.ndarray:
    """A float16 field of each super-block (2 bytes) as float32 [out, supers, 1]."""
    return field.copy().view(np.float16).astype(np.float32)


def _scales_and_mins(supers: np.ndarray, at: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's d * sc and dmin * m per block of 32, float32 [out, in / 32]."""
    rows = supers.shape[0]
    d, dmin = _halves(supers[..., 0:2]), _halves(supers[..., 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(supers[..., at:at + 12].reshape(-1, 12))
    scales = d * sc.reshape(rows, -1, 8).astype(np.float32)
    mins = dmin * m.reshape(rows, -1, 8).astype(np.float32)
    return scales.reshape(rows, -1), mins.reshape(rows, -1)


def _nibbles(packed: np.ndarray, rows: int) -> np.ndarray:
    """K-quants' 4-bit fields, 64 weights to 32 bytes (the low nibbles the first 32 weights, the
    high ones the next 32), as one code per weight, uint8 [out, in]."""
    q = packed.reshape(rows, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(rows, -1)


def _weight(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, bits: int,
            dtype: torch.dtype, block: int = BLOCK) -> GroupQuantWeight:
    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))

    return GroupQuantWeight(tensor(codes), tensor(scales),
                            None if offsets is None else tensor(offsets), bits, dtype, block)


def _from_q4_k(raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> GroupQuantWeight:
    """Q4_K (the bulk of llama.cpp's Q4_K_M files): super-blocks of 256 weights, a float16 d and
    dmin and, per block of 32, 6-bit sc and m: w = d sc q - dmin m, q 4-bit. The codes are
    re-laid in this module's order, two to a byte; scale d sc, offset -(dmin m)."""
    supers = _super_blocks(raw, shape, "Q4_K")
    scales, mins = _scales_and_mins(supers, 4)
    q = _nibbles(supers[..., 16:], shape[0]).reshape(shape[0], -1, BLOCK)
    codes = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return _weight(codes.reshape(shape[0], -1), scales, -mins, 4, dtype)


def _from_q5_k(raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> GroupQuantWeight:
    """Q5_K: Q4_K's scales and minimums, 5-bit codes (a fifth bit per weight in 32 bytes of
    high bits: bit i of byte j for weight 32 i + j), held as 8-bit codes."""
    supers = _super_blocks(raw, shape, "Q5_K")
    scales, mins = _scales_and_mins(supers, 4)
    high = supers[..., 16:48].reshape(shape[0], -1, 1, 32)
    high = (high >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    codes = _nibbles(supers[..., 48:], shape[0]) | (high.reshape(shape[0], -1) << 4)
    return _weight(codes.view(np.int8), scales, -mins, 8, dtype)


def _from_q6_k(raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> GroupQuantWeight:
    """Q6_K (Q4_K_M's value and down projections, half the layers, and its output): super-blocks
    of 256 with a float16 d and an int8 scale per block of 16: w = d scale (q - 32), q 6-bit
    (4 low bits two to a byte, 2 high bits four to a byte), held as 8-bit codes q - 32 with
    blocks of 16."""
    supers = _super_blocks(raw, shape, "Q6_K")
    rows = shape[0]
    low = supers[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
        1, 1, 1, 2, 1)
    high = supers[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    q = (low & 0x0F).reshape(rows, -1) | ((high & 0x03).reshape(rows, -1) << 4)
    codes = q.astype(np.int8) - np.int8(32)
    scales = _halves(supers[..., 208:210]) * supers[..., 192:208].view(np.int8).astype(np.float32)
    return _weight(codes, scales.reshape(rows, -1), None, 8, dtype, block=16)


_K_QUANTS = {GGML.Q4_K: _from_q4_k, GGML.Q5_K: _from_q5_k, GGML.Q6_K: _from_q6_k}
