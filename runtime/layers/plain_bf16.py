"""Few-row bfloat16 products against a plain [out, in] bfloat16 weight on the C++ library's
AVX512-BF16 dot products (spmd_cpu::bf16_linear, cpu_bf16_linear.cpp): the weights a worker
does not hold in oneDNN's blocked layout, an LM head tied to the embedding table and GGUF blocks
dequantized for one product, which oneDNN would reorder on every call. Measured on the 2-core
Zen 5 VM (docs/BENCHMARKS.md, medians of alternating repeats): SmolLM2's tied head 0.61x
oneDNN's time at 1 row (1.08 against 1.78 ms), 0.87x at 8, on par at 16-32; its layers' shapes
0.2-0.6x at 1 row, 0.7-1.0x at 32.
"""
from __future__ import annotations

import functools

import torch
from spmd_runtime.runtime.layers import cpu_ops


# The tiles take up to 8 rows of any shape they support, up to 32 while a task's panel of 8
# weight rows fits 32 KiB of L1: the rule lives in cpu_bf16_linear.cpp (bf16_linear_takes), which
# spmd_cpu::decode_layers follows too, so the one-call decode and the layer loop agree.
@functools.cache
def _takes(rows: int, in_features: int, out_features: int) -> bool:
    return cpu_ops.load() and bool(
        torch.ops.spmd_cpu.bf16_linear_takes(rows, in_features, out_features))


def plain_bf16_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """rows [M, in] @ weight [out, in]^T -> [M, out], both bfloat16 on the CPU, on the tiles;
    None where they do not run (another dtype or device, a build without AVX512-BF16, shapes
    they do not take, under torch.compile) or oneDNN is the faster."""
    if rows.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or \
            rows.device.type != "cpu" or weight.dim() != 2 or rows.dim() != 2 or \
            weight.layout != torch.strided or torch.compiler.is_compiling():
        return None
    count, in_features = rows.shape
    # 32: the rule's largest row count, checked here so the cache keeps 32 entries a shape.
    if count > 32 or not weight.is_contiguous() or \
            not _takes(count, in_features, weight.shape[0]):
        return None
    return torch.ops.spmd_cpu.bf16_linear(rows.contiguous(), weight)
