"""This project's C++ operators for CPU workers, built for the machine on first use.

cpu_attention.cpp (decode attention reading the paged KV cache in place),
cpu_quantization.cpp (the element-wise ends of an int8 projection), cpu_layers.cpp (a float32
layer's element-wise chains: residual + RMSNorm, rotary, SiLU x up), cpu_decode_layers.cpp (a
float32 decode step's whole layer stack in one call) and cpu_prefill_attention.cpp (causal
attention of a fresh prompt) form one library (cpu_math.h: math they share), compiled with
torch's C++ extension builder (a C++ compiler and ninja) at -O3 -march=native and cached under
TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions): the first worker on a machine waits a few
seconds to half a minute, later ones load it at once. Its operators live under
torch.ops.spmd_cpu. Where it cannot be built, load() says so once and the callers keep their
torch paths.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger("spmd.cpu_ops")

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_attention.cpp", "cpu_quantization.cpp", "cpu_layers.cpp",
                         "cpu_decode_layers.cpp", "cpu_prefill_attention.cpp")]


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the operators; False, with the reason logged, where they
    cannot be built here."""
    try:
        from torch.utils import cpp_extension
        cpp_extension.load(name="spmd_cpu_ops", sources=[str(path) for path in SOURCES],
                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as error:          # no compiler, no ninja, a build error: the torch paths
        log.warning("the C++ CPU operators could not be built (%s); the torch paths run instead",
                    " ".join(str(error).split())[-300:])
        return False
    return hasattr(torch.ops.spmd_cpu, "paged_decode_attention")
