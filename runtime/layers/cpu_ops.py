"""This project's C++ operators for CPU workers, built ahead and loaded for the running CPU.

cpu_attention.cpp (paged decode attention and the KV write, reading and writing the cache in
place), cpu_quantization.cpp (the element-wise ends of an int8 projection), cpu_layers.cpp (a
layer's element-wise chains: residual + RMSNorm, rotary, SiLU x up), cpu_decode_layers.cpp (a
decode step's whole layer stack in one call) and cpu_prefill_attention.cpp (causal attention of
a fresh prompt) form one library (cpu_math.h, cpu_bf16.h: what they share). It is compiled at
install, once per instruction-set level (runtime/layers/cpu_kernel_build.py: `make env`, or
`spmdrun build-kernels`), never while serving; a worker loads the most capable build its CPU
runs. Its operators live under torch.ops.spmd_cpu.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers.cpu_kernel_build import DEFAULT_ROOT, library_path

log = logging.getLogger("spmd.cpu_ops")

BUILD_COMMAND = "spmdrun build-kernels (make env runs it)"


@dataclass(frozen=True)
class KernelLibrary:
    """The build this CPU loads: its level and path, or why there is none."""

    level: str | None
    path: Path | None
    missing: str = ""


def find_library(features: cpu_features.CpuFeatures, root: Path = DEFAULT_ROOT,
                 torch_version: str = torch.__version__) -> KernelLibrary:
    """The most capable build, among those made for these sources and this torch, that the
    CPU runs."""
    runnable = features.kernel_levels
    if not runnable:
        return KernelLibrary(None, None, "the CPU has no AVX2 with FMA and F16C, the least the "
                             "C++ operators are built for")
    for level in runnable:
        path = library_path(level, torch_version, root)
        if path.exists():
            return KernelLibrary(level, path)
    return KernelLibrary(None, None, f"the C++ CPU operators are not built for this CPU "
                         f"({runnable[0]}), torch {torch_version} and these sources: run "
                         f"{BUILD_COMMAND}")


@functools.cache
def loaded() -> KernelLibrary:
    """Load this CPU's build once per process; what was loaded, or why nothing was."""
    features = cpu_features.detect()
    library = find_library(features)
    if library.path is None:
        log.warning("%s", library.missing)
        return library
    torch.ops.load_library(str(library.path))
    best = features.kernel_levels[0]
    if library.level != best:
        log.warning("the C++ CPU operators run the %s build: the build for this CPU's %s is "
                    "missing (run %s)", library.level, best, BUILD_COMMAND)
    return library


def load() -> bool:
    """Whether the operators are loaded (loading them on the first call)."""
    return loaded().path is not None and hasattr(torch.ops.spmd_cpu, "paged_decode_attention")
