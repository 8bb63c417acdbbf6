"""GGUF's quantized weights kept quantized (`--quantization gguf`): Q4_0, Q4_1, Q8_0 and Q4_K.

Each of these formats cuts a weight row into blocks of 32 and stores per block a float16 scale d
(Q4_1 also a float16 minimum m) and the codes: 4-bit codes q in [0, 15] with w = d q + m (Q4_1)
or w = d (q - 8) (Q4_0), 8-bit signed codes with w = d q (Q8_0). A GroupQuantWeight holds the
file's codes as they are (4-bit ones two to a byte, in GGUF's order) and each block's scale and
offset as float32, w = scale * q + offset (Q4_0's offset is -8d): 0.75 bytes per weight for
4-bit blocks, 1.125 for 8-bit ones, against 4 in float32. Nothing is expanded at load: a block's
weights are made, in float32, only where a product needs them (runtime/layers/
cpu_group_quant.cpp; the torch reference here where the C++ library is not built).

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
# The block formats kept quantized, with their bits per code.
KEPT_TYPES = {GGML.Q4_0: 4, GGML.Q4_1: 4, GGML.Q8_0: 8, GGML.Q4_K: 4}


@dataclass(frozen=True)
class GroupQuantWeight:
    """A [out, in] weight in blocks of 32 along its rows: codes, and per block a scale and (4-bit)
    an offset. `dtype` is the dtype its products are returned in."""

    codes: torch.Tensor             # uint8 [out, in / 2] (4-bit) or int8 [out, in] (8-bit)
    scales: torch.Tensor            # float32 [out, in / 32]
    offsets: torch.Tensor | None    # float32 [out, in / 32] (4-bit), None (8-bit)
    bits: int
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.scales.shape[1] * BLOCK))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.offsets) if t is not None]

    def __getitem__(self, index) -> GroupQuantWeight | torch.Tensor:
        """Rows (`w[a:b]`, `w[rows]`) or columns (`w[:, a:b]`): the slices a checkpoint's shards
        and stacked parts take. Columns that split blocks (a row-parallel shard of a model whose
        width per rank is not a multiple of 32) come expanded, in `dtype`."""
        if not isinstance(index, tuple):
            return self._map(lambda t, _: t[index])
        rows, columns = index
        start, stop, step = columns.indices(self.shape[1])
        if step != 1 or start % BLOCK or stop % BLOCK:
            return self.expand()[rows, columns].to(self.dtype)
        per_code = BLOCK // 2 if self.bits == 4 else BLOCK     # code bytes per block

        def columns_of(tensor: torch.Tensor, per_block: int) -> torch.Tensor:
            return tensor[rows, start // BLOCK * per_block:stop // BLOCK * per_block]

        return GroupQuantWeight(columns_of(self.codes, per_code), columns_of(self.scales, 1),
                                None if self.offsets is None else columns_of(self.offsets, 1),
                                self.bits, self.dtype)

    def _map(self, fn) -> GroupQuantWeight:
        return GroupQuantWeight(fn(self.codes, "codes"), fn(self.scales, "scales"),
                                None if self.offsets is None else fn(self.offsets, "offsets"),
                                self.bits, self.dtype)

    def pad_rows(self, count: int) -> GroupQuantWeight:
        """`count` rows, the ones past its own all zero (a vocabulary's last shard)."""
        def padded(tensor: torch.Tensor, _) -> torch.Tensor:
            pad = tensor.new_zeros((count - tensor.shape[0], *tensor.shape[1:]))
            return torch.cat([tensor, pad])

        return self._map(padded)

    def contiguous(self) -> GroupQuantWeight:
        return self._map(lambda t, _: t.contiguous())

    def to(self, dtype: torch.dtype) -> GroupQuantWeight:
        """The same codes, their products returned in `dtype` (the codes never change)."""
        return GroupQuantWeight(self.codes, self.scales, self.offsets, self.bits, dtype)

    @staticmethod
    def cat_rows(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
        """Weights stacked along their rows (a fused QKV or gate/up projection)."""
        first = parts[0]
        if any(p.bits != first.bits or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one block format and width stack")
        return GroupQuantWeight(torch.cat([p.codes for p in parts]),
                                torch.cat([p.scales for p in parts]),
                                None if first.offsets is None
                                else torch.cat([p.offsets for p in parts]), first.bits,
                                first.dtype)

    def expand(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights (or those of `rows`) as float32 [.., in]: scale * q + offset."""
        codes, scales, offsets = (self.codes, self.scales, self.offsets) if rows is None else (
            self.codes[rows], self.scales[rows], None if self.offsets is None else self.offsets[rows])
        if self.bits == 4:
            blocks = codes.view(*codes.shape[:-1], -1, BLOCK // 2)
            q = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).float()
        else:
            q = codes.view(*codes.shape[:-1], -1, BLOCK).float()
        w = q * scales.unsqueeze(-1)
        if offsets is not None:
            w = w + offsets.unsqueeze(-1)
        return w.view(*codes.shape[:-1], -1)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (a token embedding lookup), in `dtype`."""
        return self.expand(ids).to(self.dtype)


def stack_rows(parts: list) -> torch.Tensor | GroupQuantWeight:
    """Weights stacked along their rows (a fused QKV or gate/up projection): still in blocks
    where every part is; expanded where a part is a plain tensor (a tensor type not kept)."""
    if all(isinstance(part, GroupQuantWeight) for part in parts):
        return GroupQuantWeight.cat_rows(parts)
    dtype = next(part.dtype for part in parts if isinstance(part, torch.Tensor))
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
                                                    weight.offsets, weight.bits)
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
    if tensor_type == GGML.Q4_K:
        return _from_q4_k(raw, shape, dtype)
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


def _from_q4_k(raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> GroupQuantWeight:
    """Q4_K (the bulk of llama.cpp's Q4_K_M files): super-blocks of 256 weights, each a float16
    d and dmin and, per block of 32, a 6-bit scale sc and minimum m: w = d sc q - dmin m. The
    codes are re-laid in this module's order (GGUF packs them 64 weights to 32 bytes: the low
    nibbles the first 32, the high ones the next 32); scale d sc, offset -(dmin m)."""
    out_features, in_features = shape
    if in_features % 256:
        raise ValueError(f"a Q4_K tensor of shape {shape} does not split into blocks of 256")
    supers = np.ascontiguousarray(raw).view(np.uint8).reshape(out_features, in_features // 256, -1)
    d = supers[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = supers[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(supers[..., 4:16].reshape(-1, 12))
    sc = sc.reshape(out_features, -1, 8).astype(np.float32)
    m = m.reshape(out_features, -1, 8).astype(np.float32)
    scales = (d[..., None] * sc).reshape(out_features, -1)
    offsets = -(dmin[..., None] * m).reshape(out_features, -1)
    packed = supers[..., 16:].reshape(out_features, -1, 4, 1, 32)
    q = (packed >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    q = q.reshape(out_features, -1, BLOCK)        # weight order, a block of 32 a row
    codes = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return GroupQuantWeight(torch.from_numpy(np.ascontiguousarray(codes).reshape(out_features, -1)),
                            torch.from_numpy(np.ascontiguousarray(scales)),
                            torch.from_numpy(np.ascontiguousarray(offsets)), 4, dtype)
