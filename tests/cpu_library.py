"""The C++ CPU library in tests: loaded wherever this CPU has a build level (make env built it).
Tests that need it skip only on a CPU with no level (no AVX2): on any other, a missing or broken
build fails them instead of hiding behind a skip."""
from __future__ import annotations

import pytest
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers import cpu_ops

BUILT_FOR_THIS_CPU = bool(cpu_features.detect().kernel_levels)
if BUILT_FOR_THIS_CPU:
    cpu_ops.load()

needs_cpu_ops = pytest.mark.skipif(not BUILT_FOR_THIS_CPU, reason="this CPU has no AVX2 with FMA "
                                   "and F16C: the C++ library is built for none of its levels")

# Where the CPU has AVX512-BF16 the library's level has the bf16 tiles (plain_bf16.py, the fused
# GGUF products): a build without them fails the tests that need them rather than skipping.
CPU_HAS_BF16 = BUILT_FOR_THIS_CPU and "avx512_bf16" in cpu_features.detect().flags
needs_bf16_tiles = pytest.mark.skipif(not CPU_HAS_BF16, reason="this CPU has no AVX512-BF16: "
                                      "the library has no bf16 tiles for it")

# Where the CPU has AVX-512 the library's level has gguf_linear's float32 panels.
CPU_HAS_AVX512 = BUILT_FOR_THIS_CPU and "avx512f" in cpu_features.detect().flags
needs_f32_panels = pytest.mark.skipif(not CPU_HAS_AVX512, reason="this CPU has no AVX-512: the "
                                      "library has no float32 panels for GGUF blocks")

# Where the CPU has AVX-512 BW and VNNI the library's level multiplies 8-bit activations by GGUF
# blocks of 32 (`--quantization int8` over a GGUF file).
CPU_HAS_INT8_BLOCKS = BUILT_FOR_THIS_CPU and {"avx512bw", "avx512_vnni"} <= cpu_features.detect().flags
needs_int8_blocks = pytest.mark.skipif(not CPU_HAS_INT8_BLOCKS, reason="this CPU has no AVX-512 "
                                       "VNNI: the library has no 8-bit activation products")
