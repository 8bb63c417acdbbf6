"""Tensor parallelism: how each weight is split across the ranks of a TP group, and the
collectives that put partial results back together.

Column-parallel layers (merged QKV, merged gate/up) split their output features: each rank
computes its heads or its slice of the MLP. Row-parallel layers (attention output, MLP down)
split their input features, so each rank holds a partial sum that an all-reduce completes; a
bias is added once, after the reduction, on every rank. The embedding and the LM head split the
vocabulary: out-of-shard ids embed to zero before an all-reduce, and shard logits are gathered
so every rank samples from the same full row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.layers.bf16_panels import panel_residual_product
from spmd_runtime.runtime.layers.group_quant import Blocks, GroupQuantWeight, fused_bf16_part
from spmd_runtime.runtime.layers.int8_blocks import int8_residual_product
from spmd_runtime.runtime.layers.linear import linear
from spmd_runtime.runtime.preflight import tensor_parallel_problem


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group, and how row-parallel reductions are chunked."""

    rank: int = 0
    size: int = 1
    group: object | None = None         # the torch.distributed group; None: the default one
    row_parallel_chunks: int = 1
    row_parallel_chunk_threshold: int = 8192

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's shard of the last dimension, in rank order."""
        if self.size == 1:
            return x
        shards = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(shards, x.contiguous(), group=self.group)
        return torch.cat(shards, dim=-1)


@dataclass(frozen=True)
class ShardLayout:
    """Which heads, MLP features and vocabulary rows one rank holds.

    The key/value heads are split whole, each with its group of query heads. Where the ranks do
    not divide them (smollm2's 3 over 2 ranks), the first ranks take one more: ranks then hold
    unequal shares of the attention (and of its KV cache), never a part of a group."""

    num_heads: int                  # query heads on this rank
    num_kv_heads: int               # key/value heads on this rank (replicated when TP > kv heads)
    kv_head_start: int
    intermediate_size: int          # MLP features on this rank
    vocab_start: int
    vocab_per_rank: int             # vocabulary rows per rank (the last rank's may be padding)
    q_head_start: int = 0

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> ShardLayout:
        size, rank = tp.size, tp.rank
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        problem = tensor_parallel_problem(config, size)
        if problem:
            raise ValueError(problem)
        if kv_heads >= size:
            base, extra = divmod(kv_heads, size)
            num_kv, kv_start = base + (rank < extra), rank * base + min(rank, extra)
            group = heads // kv_heads
            num_q, q_start = num_kv * group, kv_start * group
        else:
            # More ranks than KV heads: each KV head serves size // kv_heads ranks, whose query
            # heads are exactly the ones that head's group holds.
            num_kv, kv_start = 1, rank // (size // kv_heads)
            num_q, q_start = heads // size, rank * (heads // size)
        vocab_per_rank = -(-config.vocab_size // size)
        return cls(num_q, num_kv, kv_start, config.intermediate_size // size,
                   rank * vocab_per_rank, vocab_per_rank, q_start)


def read_shard(source, shard: tuple[int, int, int] | None) -> torch.Tensor:
    """`source` whole, or the (dimension, start, count) shard of it: rows (zero-padded past the
    end) or columns. `source` is a tensor, or a safetensors slice that reads only what is
    indexed."""
    if shard is None:
        return source[:]
    dim, start, count = shard
    return shard_rows(source, start, count) if dim == 0 else source[:, start:start + count]


def read_stacked_parts(source, parts: list[tuple[str, int]], spec=None) -> dict[str, torch.Tensor]:
    """The parts of a tensor that stacks several weights along its rows (a fused checkpoint's
    QKV or gate/up), by name: each whole, or with `spec` (name -> (0, start, count) or None)
    this rank's rows of each, so that a rank takes its rows of every part, not of the stack."""
    out, offset = {}, 0
    for name, rows in parts:
        shard = spec(name) if spec else None
        if shard is not None and shard[0] != 0:
            raise ValueError(f"{name}: a stacked part can only be split along its rows")
        start, count = (0, rows) if shard is None else shard[1:]
        out[name] = source[offset + start:offset + start + count]
        offset += rows
    return out


def shard_rows(weight, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count), zero-padded past the end (a vocabulary's last shard)."""
    part = weight[start:start + count]
    if part.shape[0] < count and isinstance(part, GroupQuantWeight):
        return part.pad_rows(count)
    if part.shape[0] < count:
        pad = torch.zeros((count - part.shape[0],) + tuple(part.shape[1:]), dtype=part.dtype)
        part = torch.cat([part, pad])
    return part


def vocab_parallel_embedding(ids: torch.Tensor, shard: torch.Tensor, vocab_start: int,
                             tp: TensorParallel) -> torch.Tensor:
    lookup = shard.embedding if isinstance(shard, GroupQuantWeight) else \
        (lambda rows: torch.nn.functional.embedding(rows, shard))
    if tp.size == 1:
        return lookup(ids)
    local = ids - vocab_start
    outside = (local < 0) | (local >= shard.shape[0])
    x = lookup(local.masked_fill(outside, 0))
    x.masked_fill_(outside.unsqueeze(-1), 0.0)
    return tp.all_reduce(x)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        tp: TensorParallel) -> torch.Tensor:
    """x [..., in/tp] @ weight[out, in/tp]^T, all-reduced, plus bias once.

    With `row_parallel_chunks` N > 1, TP > 1 and at least `row_parallel_chunk_threshold`
    tokens, the input is split into N chunks (2D: along tokens; 3D: along the sequence for a
    prefill, along the batch for a decode) and each chunk's all-reduce is launched
    asynchronously as soon as its matmul is done, so it overlaps the next chunk's matmul.
    """
    num_tokens = x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[1]
    chunks = tp.row_parallel_chunks
    if chunks <= 1 or tp.size == 1 or num_tokens < tp.row_parallel_chunk_threshold:
        parts, dim = (x,), 0
    else:
        dim = 0 if x.dim() == 2 or x.shape[1] == 1 else 1
        parts = x.chunk(chunks, dim=dim)
    pieces, works = [], []
    for part in parts:
        partial = linear(part.contiguous(), weight)
        if tp.size > 1:
            works.append(dist.all_reduce(partial, group=tp.group, async_op=True))
        pieces.append(partial)
    for work in works:
        work.wait()
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
    return out if bias is None else out + bias


def residual_row_parallel_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                 tp: TensorParallel) -> torch.Tensor:
    """residual + row_parallel_linear(x, weight, None, tp). On one rank, where x's bf16 CPU
    rows times a weight's GGUF blocks take the fused bf16 kernel, the residual is added in the
    product (spmd_cpu::gguf_bf16_residual_linear: the same bits as the add; past 48 rows in
    its tiles' epilogue, a 512-token prompt step's 30 separate adds ~2 ms on 2 Zen 5 cores);
    so it is where they take 8-bit activations (int8_blocks.int8_residual_product) and for a
    bf16 weight held as panels (bf16_panels.panel_residual_product)."""
    part = residual_in_product(residual, x, weight, tp)
    if part is None:
        fused = None
        if tp.size == 1:
            fused = panel_residual_product(residual, x, weight)
            if fused is None:
                fused = int8_residual_product(residual, x, weight)
        return residual + row_parallel_linear(x, weight, None, tp) if fused is None else fused
    return torch.ops.spmd_cpu.gguf_bf16_residual_linear(
        x.contiguous(), part.data, int(part.kind), weight.in_features, residual.contiguous())


def residual_in_product(residual: torch.Tensor, x: torch.Tensor, weight: object,
                        tp: TensorParallel) -> Blocks | None:
    """The GGUF blocks whose bf16 product with x adds the residual in its epilogue
    (residual_row_parallel_linear), or None where the residual is added after the product."""
    part = fused_bf16_part(x, weight) if tp.size == 1 else None
    if part is None or residual.shape != (x.shape[0], part.data.shape[0]) or \
            residual.dtype != torch.bfloat16:
        return None
    return part
