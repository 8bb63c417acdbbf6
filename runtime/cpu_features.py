"""What the running x86 CPU can do: the instruction-set level the C++ kernels are built for, and
whether bfloat16 is the CPU's fast dtype. Read from the kernel's flags; no torch."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# Kernel builds from the most capable down: a CPU runs the first whose flags it has. Each level
# names the compiler flags of its build and the /proc/cpuinfo flags a CPU needs to run it.
KERNEL_LEVELS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "amx": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
             "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
             "-mamx-int8"),
            frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                       "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"})),
    "avx512bf16": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512dq", "-mavx512vnni", "-mavx512bf16"),
                   frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                              "avx512dq", "avx512_vnni", "avx512_bf16"})),
    "avx512vnni": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512dq", "-mavx512vnni"),
                   frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                              "avx512dq", "avx512_vnni"})),
    "avx512": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                "-mavx512dq"),
               frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
}


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    model: str = ""
    vendor: str = ""                # vendor_id: GenuineIntel, AuthenticAMD, ...

    @property
    def kernel_levels(self) -> list[str]:
        """The kernel builds this CPU can run, the most capable first."""
        return [level for level, (_, needs) in KERNEL_LEVELS.items() if needs <= self.flags]

    def bfloat16_reason(self) -> str | None:
        """Why bfloat16 is this CPU's fast dtype (as vLLM's CPU backend decides), or None."""
        if {"amx_bf16", "amx_tile"} <= self.flags:
            return "the CPU has AMX bf16 tiles"
        if "avx512_bf16" in self.flags:
            return "the CPU has AVX512-BF16 dot products"
        return None


def parse_cpuinfo(text: str) -> CpuFeatures:
    flags: frozenset[str] = frozenset()
    model = vendor = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
    return CpuFeatures(flags, model, vendor)


@functools.cache
def detect() -> CpuFeatures:
    """This machine's CPU (no flags where /proc/cpuinfo cannot be read: not Linux, not x86)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuFeatures(frozenset())


def resolve_dtype_name(requested: str, device_type: str,
                       features: CpuFeatures | None = None) -> tuple[str, str]:
    """`--dtype` for a worker on `device_type`: (dtype name, why). "auto" is bfloat16 on CUDA
    and on a CPU that computes it natively (AMX or AVX512-BF16, `features`: this machine's by
    default), float32 on other CPUs."""
    if requested != "auto":
        return requested, "asked for with --dtype"
    if device_type != "cpu":
        return "bfloat16", f"--dtype auto on {device_type}"
    reason = (features or detect()).bfloat16_reason()
    if reason is not None:
        return "bfloat16", f"--dtype auto on the CPU: {reason}"
    return "float32", ("--dtype auto on the CPU: it has neither AMX nor AVX512-BF16, so bfloat16 "
                       "would be emulated, slower than float32")
