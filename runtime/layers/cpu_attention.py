"""Decode attention that reads the paged KV cache in place on the CPU: a small C++ operator.

The torch path (runtime.layers.attention) gathers each decode group's context blocks into a
contiguous copy and runs SDPA over it, a group of a few sequences at a time: every context
token's K and V are read, written and read again, and a batch of 64 decodes costs 16 gathers
and 8 SDPA calls per layer. The operator in cpu_attention.cpp reads each token's K and V once,
from its slot, for the whole batch in one call, split over the intra-op threads by (sequence,
KV head). It computes the same softmax(q k^T * scale) v in float32.

It is compiled for this machine (-O3 -march=native) the first time a worker needs it, with
torch's C++ extension builder (a C++ compiler and ninja), and cached under
TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions); `load()` says whether it is usable.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger("spmd.attention")

SOURCE = Path(__file__).with_name("cpu_attention.cpp")


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the operator; False, with the reason logged, where it
    cannot be built here."""
    try:
        from torch.utils import cpp_extension
        cpp_extension.load(name="spmd_cpu_attention", sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as error:          # no compiler, no ninja, a build error: use the torch path
        log.warning("the CPU decode-attention kernel could not be built (%s); decode attention "
                    "gathers its context instead", str(error).strip().splitlines()[-1:])
        return False
    return hasattr(torch.ops.spmd_cpu, "paged_decode_attention")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q: [n, heads, dim], one query per sequence; caches: [slots, kv_heads, dim] float32;
    block_tables: [n, blocks] (int32 or int64); lengths: [n] int32 context tokens, each >= 1.
    Returns [n, heads, dim]."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return torch.ops.spmd_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, lengths,
                                                     block_size, scale)
