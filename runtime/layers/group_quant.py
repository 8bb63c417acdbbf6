"""GGUF's quantized weights kept quantized (`--quantization gguf`): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
and the K-quants Q4_K, Q5_K and Q6_K, held as the file's own block bytes.

Each format cuts a weight row into blocks (32 weights; the K-quants' super-blocks 256) of
scales and codes: Q4_0 and Q4_1 a float16 d (Q4_1 also a minimum m) and 4-bit codes q, w =
d (q - 8) or d q + m; Q5_0 and Q5_1 likewise with 5-bit codes; Q8_0 8-bit signed codes, w = d q;
the K-quants 6-bit (Q6_K: 8-bit) scales per block of 32 (16) under a float16 d and dmin. A
GroupQuantWeight holds each output feature's row of blocks exactly as the file stores it
(Q4_K: 4.5 bits a weight, Q6_K: 6.56), nothing converted at load; a fused projection of parts
of different types (Q4_K_M's Q4_K queries and keys beside Q6_K values) holds one part per type.

The products (runtime/layers/cpu_group_quant.cpp): at decode's few rows the activations are
held as 16-bit fixed point per block of 32 (per super-block of 256 for the K-quants where the
kernels are built with AVX512-VNNI) and multiplied by the block codes with integer dot
products; past f32_integer_rows rows each task dequantizes a panel of output features to
float32 (gguf's own values) inside the product for FMA tiles (MKL's GEMM on 64 features at a
time without AVX-512). bfloat16 activations past bf16_gemm_rows rows multiply weights rounded
to bfloat16, dequantized a panel at a time inside the library's VDPBF16PS tiles
(gguf_bf16_linear; oneDNN's bf16 GEMM on chunks without AVX512-BF16); `--quantization int8`
takes 8-bit activations (int8_blocks.py). `expand` is gguf's own dequantisation, what
`--quantization none` loads; on CUDA, or without the C++ library, torch operations (gguf_torch.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from itertools import groupby

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GGML
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers import cpu_ops, gguf_torch
from spmd_runtime.runtime.layers.int8_blocks import int8_product, int8_silu_product, takes_int8
from spmd_runtime.runtime.loaders.gguf_file import KEPT_BLOCK_TYPES

# Up to this many rows a product holds the activations as 16-bit fixed point and multiplies with
# integer dot products; past it, float32 activations through the GEMM. bench/quant_quality.py raises it
# to measure every position as decode computes it.
DIRECT_ROWS = 32
# bfloat16 activations past this many rows (where the fused kernel below is not built): the
# weights are dequantized BF16_CHUNK_VALUES values at a time (8 MiB of bf16) and multiplied by
# oneDNN's bf16 GEMM. Measured on AVX512-BF16 (Zen 5, 2 cores): the two cost the same at ~12
# rows, for SmolLM2's Q4_1 and Q8_0 projections (integer dot products ~0.06 ms a row and layer,
# dequantising and the GEMM ~0.55 ms + 0.01 a row) and an 8B model's Q4_K and Q6_K ones (4096 x
# 4096: 0.24 ms a row, against 2.5 ms + 0.04 a row).
BF16_GEMM_ROWS = 12
BF16_CHUNK_VALUES = 1 << 22
# Builds with AVX512-BF16 dequantize the weights a panel of output features at a time into L1/L2
# and multiply them there (spmd_cpu::gguf_bf16_linear), at every row count past
# FUSED_INTEGER_ROWS for the blocks of 32 (SmolLM2's decode step of 12 rows 27 -> 16 ms, of 32
# rows 34.5 -> 26.4; an 8B-shaped Q4_0/Q4_1/Q8_0 projection 0.9-0.6x the integer products' time
# at 2-16 rows) and past DIRECT_ROWS for the K-quants: the rounded weights' products at oneDNN's
# prepacked bf16 speed from ~128 rows, 0.75-1.0x the time of the chunks below at 32-512 rows.
FUSED_INTEGER_ROWS = 1           # with the fused kernel, a lone row stays integer (7.3 ms a
                                 # SmolLM2 decode step against 8.3)
# Kernel builds with AVX512-VNNI (cpu_group_quant_vnni.h): their K-quant products stay integer
# with bfloat16 activations up to these rows where the fused kernel is built (DIRECT_ROWS where
# it is not): past them the fused kernel's rows-in-lanes tiles are faster. Measured on an 8B
# model's 6144 x 4096, 4096 x 4096 and 4096 x 14336 projections (Zen 5, 2 cores): the integer
# products' time over the fused kernel's is 0.80-0.83 at 16 rows, 0.96-1.13 at 20 and 1.43-1.85
# at 32 for Q4_K (whose 16 levels the fused kernel looks up in a table); Q5_K 1.04-1.19 at 24,
# Q6_K 0.91-1.03 at 24 and 1.06-1.29 at 28.
K_QUANT_TYPES = (GGML.Q4_K, GGML.Q5_K, GGML.Q6_K)
K_QUANT_INTEGER_ROWS = {GGML.Q4_K: 19, GGML.Q5_K: 23, GGML.Q6_K: 25}
# float32 activations, where the library is built with AVX-512 (spmd_cpu::gguf_linear's
# float32 panels, cpu_f32_gemm.h): the integer products up to these rows, past them the weights
# dequantized to float32 a panel at a time inside the product, gguf's own values multiplied in
# float32 (where the library is not, the integer products up to DIRECT_ROWS, then 64-feature
# chunks for MKL's GEMM). Measured on 2 Zen 5 cores against the integer products (layer of
# SmolLM2's shapes and of 1024-4096 wide ones): blocks of 32 cross at 9-10 rows (Q4_1's 32 rows
# 0.59 against 1.31 ms, 512 rows 7.3 ms against MKL's 16.2 on the dense weight), Q8_0 between 16
# and 32; the K-quants' integer products with AVX512-VNNI stay ahead to ~128 rows (Q6_K at 128:
# 4.8 against 5.5 ms), without VNNI the integer products keep DIRECT_ROWS.
F32_INTEGER_ROWS = {GGML.Q4_0: 8, GGML.Q4_1: 8, GGML.Q5_0: 8, GGML.Q5_1: 8, GGML.Q8_0: 16}
F32_K_QUANT_VNNI_INTEGER_ROWS = 128


@functools.cache
def _fused_bf16(in_features: int, out_features: int) -> bool:
    """Whether the loaded library has spmd_cpu::gguf_bf16_linear for this shape."""
    return cpu_ops.load() and bool(
        torch.ops.spmd_cpu.gguf_bf16_linear_supported(in_features, out_features))


def vnni_kernels() -> bool:
    """Whether the loaded C++ library is a build with AVX512-VNNI (its kernel level needs it)."""
    level = cpu_ops.loaded().level
    return level is not None and "avx512_vnni" in cpu_features.KERNEL_LEVELS[level][1]


def bf16_gemm_rows(kind: GGML, in_features: int, out_features: int) -> int:
    """Past this many bfloat16 rows, a product of `kind`'s blocks takes bf16 products (fused or
    through oneDNN) rather than the integer ones."""
    fused = _fused_bf16(in_features, out_features)
    if kind in K_QUANT_TYPES and vnni_kernels():
        return min(K_QUANT_INTEGER_ROWS[kind], DIRECT_ROWS) if fused else DIRECT_ROWS
    return FUSED_INTEGER_ROWS if fused else BF16_GEMM_ROWS


@functools.cache
def _fused_f32(in_features: int, out_features: int) -> bool:
    """Whether the loaded library multiplies float32 rows by this shape's blocks dequantized to
    float32 panels (spmd_cpu::gguf_linear past its integer rows)."""
    return cpu_ops.load() and bool(
        torch.ops.spmd_cpu.gguf_linear_fused(in_features, out_features))


def f32_integer_rows(kind: GGML, in_features: int, out_features: int) -> int:
    """Up to this many float32 rows, a product of `kind`'s blocks takes the integer products;
    past it the float32 panels (or, where they are not built, MKL's GEMM of dequantized
    chunks)."""
    if not _fused_f32(in_features, out_features):
        return DIRECT_ROWS
    if kind in K_QUANT_TYPES:
        return F32_K_QUANT_VNNI_INTEGER_ROWS if vnni_kernels() else DIRECT_ROWS
    return F32_INTEGER_ROWS[kind]


# The block formats kept quantized: (weights, bytes) per block.
KEPT_TYPES = {kind: gguf.GGML_QUANT_SIZES[kind] for kind in KEPT_BLOCK_TYPES}


@dataclass(frozen=True)
class Blocks:
    """One GGUF tensor's rows of blocks: uint8 [out, bytes a row], of `kind`."""

    data: torch.Tensor
    kind: GGML

    def expand(self, in_features: int) -> torch.Tensor:
        """The weights as float32 [out, in] on the blocks' device: gguf's own dequantisation
        (on another device than the CPU, gguf_torch's, bit for bit the same)."""
        if self.data.device.type != "cpu":
            return gguf_torch.dequantize(self.data, self.kind, in_features)
        if not self.data.shape[0]:
            return torch.empty(0, in_features)
        raw = self.data.numpy()
        return torch.from_numpy(gguf.quants.dequantize(raw, self.kind).reshape(-1, in_features))

    def product(self, rows: torch.Tensor, in_features: int) -> torch.Tensor:
        """float32 rows [M, in] @ the weights^T -> [M, out]: the C++ kernels on the CPU; on
        another device (or without the library) the weight expanded there by torch operations
        for this product alone."""
        if rows.device.type == "cpu" and cpu_ops.load():
            return torch.ops.spmd_cpu.gguf_linear(
                rows, self.data, int(self.kind), in_features,
                f32_integer_rows(self.kind, in_features, self.data.shape[0]))
        return F.linear(rows, gguf_torch.dequantize(self.data.to(rows.device), self.kind, in_features))

    def bf16_product(self, rows: torch.Tensor, in_features: int,
                     float32_out: bool = False) -> torch.Tensor:
        """bfloat16 rows [M, in] on the CPU @ the weights^T -> bfloat16 [M, out], the weights
        rounded to bfloat16: dequantized a panel at a time inside the library's product where
        it is built with AVX512-BF16 (gguf_bf16_linear; with float32_out, its float32 sums
        unrounded), else a chunk of output features at a time through oneDNN's bf16 GEMM."""
        if _fused_bf16(in_features, self.data.shape[0]):
            return torch.ops.spmd_cpu.gguf_bf16_linear(rows.contiguous(), self.data,
                                                       int(self.kind), in_features, float32_out)
        step = max(64, BF16_CHUNK_VALUES // in_features)
        return torch.cat([F.linear(rows, torch.ops.spmd_cpu.gguf_dequantize_bf16(
            self.data[n:n + step], int(self.kind), in_features))
            for n in range(0, self.data.shape[0], step)], dim=1)


@dataclass(frozen=True)
class GroupQuantWeight:
    """A [out, in] weight as GGUF blocks: one run of rows per type (one, but for a fused
    projection of parts of different types). `dtype` is the dtype its products are returned in."""

    parts: tuple[Blocks, ...]
    in_features: int
    dtype: torch.dtype = torch.float32
    # `--quantization int8`: its products at takes_int8's row counts quantize the activations
    # to 8 bits per block of 32 and multiply them by the blocks' codes in integers.
    int8_activations: bool = False

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.data.shape[0] for p in self.parts), self.in_features))

    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.parts]

    def __getitem__(self, index) -> GroupQuantWeight | torch.Tensor:
        """Rows (`w[a:b]`, `w[rows]`) or columns (`w[:, a:b]`): the slices a checkpoint's shards
        and stacked parts take. Columns that split blocks (a row-parallel shard of a model whose
        width per rank is not a multiple of the block) come expanded, in `dtype`."""
        if not isinstance(index, tuple):
            return self._rows(index)
        rows, columns = index
        start, stop, step = columns.indices(self.in_features)
        weights = [KEPT_TYPES[p.kind][0] for p in self.parts]
        if step != 1 or any(start % w or stop % w for w in weights):
            return self.expand()[rows, columns].to(self.dtype)
        parts = []
        for part, per_block in zip(self.parts, weights, strict=True):
            size = KEPT_TYPES[part.kind][1]
            parts.append(Blocks(part.data[:, start // per_block * size:stop // per_block * size],
                                part.kind))
        return replace(self, parts=tuple(parts), in_features=stop - start)._rows(rows)

    def _rows(self, index) -> GroupQuantWeight:
        if len(self.parts) == 1:
            part = self.parts[0]
            return self._with([Blocks(part.data[index], part.kind)])
        start, stop, step = index.indices(self.shape[0]) if isinstance(index, slice) else (0, 0, 0)
        if step != 1:
            raise ValueError("rows of a weight stacked from parts of different GGUF types are "
                             "taken by a slice of step 1, not by an index")
        parts, offset = [], 0
        for part in self.parts:
            count = part.data.shape[0]
            lo, hi = max(start - offset, 0), min(stop - offset, count)
            if lo < hi:
                parts.append(Blocks(part.data[lo:hi], part.kind))
            offset += count
        return self._with(parts)

    def _with(self, parts: list[Blocks]) -> GroupQuantWeight:
        return replace(self, parts=tuple(parts))

    def pad_rows(self, count: int) -> GroupQuantWeight:
        """`count` rows, the ones past its own all zero (a vocabulary's last shard): blocks of
        zero bytes, whose scales are zero."""
        last = self.parts[-1]
        pad = last.data.new_zeros((count - self.shape[0], last.data.shape[1]))
        return self._with([*self.parts[:-1], Blocks(torch.cat([last.data, pad]), last.kind)])

    def to(self, device: torch.device) -> GroupQuantWeight:
        return self._with([Blocks(p.data.to(device), p.kind) for p in self.parts])

    def contiguous(self) -> GroupQuantWeight:
        return self._with([Blocks(p.data.contiguous(), p.kind) for p in self.parts])

    def expand(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights (or those of `rows`) as float32 [.., in]: gguf's dequantisation."""
        if rows is None:
            return torch.cat([p.expand(self.in_features) for p in self.parts])
        if len(self.parts) > 1:
            return self.expand()[rows]
        part = self.parts[0]
        flat = rows.reshape(-1).to(part.data.device)
        return Blocks(part.data[flat], part.kind).expand(self.in_features).view(
            *rows.shape, self.in_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (a token embedding lookup), in `dtype`, on ids' device; Q8_0 rows on
        the CPU dequantized by the library (gguf's values bit for bit, ~6x its numpy's speed)."""
        part, ops = self.parts[0], {torch.float32: "gguf_dequantize", torch.bfloat16: "gguf_dequantize_bf16"}
        if len(self.parts) == 1 and part.kind == GGML.Q8_0 and ids.device.type == "cpu" == \
                part.data.device.type and self.dtype in ops and cpu_ops.load():
            return getattr(torch.ops.spmd_cpu, ops[self.dtype])(part.data.index_select(
                0, ids.reshape(-1)), int(part.kind), self.in_features).view(*ids.shape, self.in_features)
        return self.expand(ids).to(device=ids.device, dtype=self.dtype)


def stack_rows(parts: list) -> torch.Tensor | GroupQuantWeight:
    """Weights stacked along their rows (a fused QKV or gate/up projection): still in blocks
    where every part is (runs of the same type joined); expanded where a part is a plain tensor
    (a type not kept)."""
    if all(isinstance(part, GroupQuantWeight) for part in parts):
        blocks = (b for part in parts for b in part.parts)
        runs = tuple(Blocks(torch.cat([b.data for b in run]), kind)
                     for kind, run in groupby(blocks, key=lambda b: b.kind))
        return GroupQuantWeight(runs, parts[0].in_features, parts[0].dtype)
    dtype = next(part.dtype for part in parts if not isinstance(part, GroupQuantWeight))
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


def move_to(model: torch.nn.Module, device: torch.device) -> None:
    """The weights kept in blocks (which `model.to` does not see: they are no parameters) onto
    `device`."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, GroupQuantWeight):
                object.__setattr__(module, name, value.to(device))


def group_quant_linear(x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None,
                       float32_out: bool = False) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias), in x's dtype (float32 with float32_out: logits, whose
    top-1 a bf16 rounding would tie); the products in float32, but for bfloat16 activations
    past bf16_gemm_rows rows on the CPU (Blocks.bf16_product: their float32 sums kept with
    float32_out, where the fused kernel is built)."""
    rows = x.reshape(-1, x.shape[-1])
    out_dtype = torch.float32 if float32_out else x.dtype
    if takes_int8(weight, rows.shape[0]):
        out = int8_product(rows, weight, bias).to(out_dtype)
        return out.view(*x.shape[:-1], weight.shape[0])
    bf16 = x.dtype == torch.bfloat16 and x.device.type == "cpu" and cpu_ops.load()
    wide = None
    outs = []
    for part in weight.parts:
        if bf16 and rows.shape[0] > bf16_gemm_rows(part.kind, weight.in_features,
                                                   part.data.shape[0]):
            outs.append(part.bf16_product(rows, weight.in_features, float32_out))
        else:
            wide = rows.float().contiguous() if wide is None else wide
            outs.append(part.product(wide, weight.in_features))
    out = outs[0] if len(outs) == 1 else torch.cat([o.to(out_dtype) for o in outs], dim=1)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype).view(*x.shape[:-1], out.shape[-1])


# Past this many bfloat16 rows (the rows-in-the-lanes tiles' most, cpu_bf16_gemm.h
# kLanesMaxRows) gguf_bf16_linear takes its packed panels, and a fused gate/up projection's
# SiLU x up can run in their epilogue (gguf_bf16_silu_linear, the same bits).
GATED_FROM_ROWS = 49


def fused_bf16_part(rows: torch.Tensor, weight: object, min_rows: int = 0) -> Blocks | None:
    """The one part of a GGUF weight (of a single block type) whose product with these bf16
    CPU rows [M, in] the fused bf16 kernel takes (past its integer rows and min_rows, not on
    8-bit activations), or None."""
    if not isinstance(weight, GroupQuantWeight) or len(weight.parts) != 1 or \
            rows.dtype != torch.bfloat16 or rows.device.type != "cpu" or rows.dim() != 2 or \
            takes_int8(weight, rows.shape[0]):
        return None
    part, out_features = weight.parts[0], weight.parts[0].data.shape[0]
    if rows.shape[0] < min_rows or part.data.device.type != "cpu" or \
            rows.shape[0] <= bf16_gemm_rows(part.kind, weight.in_features, out_features) or \
            not _fused_bf16(weight.in_features, out_features):
        return None
    return part


def silu_gated_part(rows: torch.Tensor, weight: object) -> Blocks | None:
    """The blocks silu_gated_product multiplies these rows by in one product, or None."""
    part = fused_bf16_part(rows, weight, GATED_FROM_ROWS)
    return None if part is None or part.data.shape[0] % 32 else part


def silu_gated_product(rows: torch.Tensor, weight: object) -> torch.Tensor | None:
    """SiLU(rows @ gate^T) * (rows @ up^T) for a fused gate/up projection (gate rows first) of
    one block type, in one C++ product whose tiles finish each output (the [rows, 2 x
    intermediate] product never written): bf16 rows on the CPU past GATED_FROM_ROWS, where the
    fused bf16 kernel is built, or 8-bit activations (int8_blocks.int8_silu_product); None for
    anything else (the caller multiplies, then silu_mul)."""
    part = silu_gated_part(rows, weight)
    if part is None:
        return int8_silu_product(rows, weight)
    return torch.ops.spmd_cpu.gguf_bf16_silu_linear(rows.contiguous(), part.data, int(part.kind),
                                                    weight.in_features)


def decode_layers_blocks(weight: GroupQuantWeight,
                         rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (blocks, int64 [GGML type, in_features]) slot pair spmd_cpu::decode_layers takes for
    a projection of one block type whose products at `rows` rows are the fused kernel's, as
    group_quant_linear multiplies it: bf16 past bf16_gemm_rows (gguf_bf16_linear), float32 past
    f32_integer_rows (gguf_linear's float32 panels); None for any other."""
    if len(weight.parts) != 1 or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    part = weight.parts[0]
    if takes_int8(weight, rows):
        return part.data, _block_info(int(part.kind), weight.in_features, 1)
    shape = (weight.in_features, part.data.shape[0])
    if weight.dtype == torch.bfloat16:
        fused = _fused_bf16(*shape) and rows > bf16_gemm_rows(part.kind, *shape)
    else:
        fused = _fused_f32(*shape) and rows > f32_integer_rows(part.kind, *shape)
    if part.data.device.type != "cpu" or not fused:
        return None
    return part.data, _block_info(int(part.kind), weight.in_features)


@functools.cache
def _block_info(kind: int, in_features: int, *int8_activations: int) -> torch.Tensor:
    return torch.tensor([kind, in_features, *int8_activations], dtype=torch.int64)


def from_gguf_blocks(raw: np.ndarray, tensor_type: GGML, shape: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> GroupQuantWeight:
    """A GGUF tensor's bytes (`shape` = [out, in], Hugging Face's order) as a GroupQuantWeight:
    its rows of blocks copied as they are."""
    out_features, in_features = shape
    per_block, size = KEPT_TYPES[tensor_type]
    if in_features % per_block:
        raise ValueError(f"a {tensor_type.name} tensor of shape {shape} does not split into "
                         f"blocks of {per_block}")
    data = np.array(raw, dtype=np.uint8, copy=True).reshape(out_features, in_features // per_block * size)
    return GroupQuantWeight((Blocks(torch.from_numpy(data), tensor_type),), in_features, dtype)
