"""What one core of this CPU can issue: clock, dot-product rates, and which ops share their pipes.

The int8 products (runtime/layers/cpu_group_quant_int8.h) and the bf16 ones are judged against
these rates, so they are measured here, not assumed. Each figure comes from a loop of 16-24
independent chains of one instruction (registers only, written as inline assembly so that the
compiler can neither merge the chains nor spill them): fewer chains, or chains the compiler may
fold together, measure the instruction's latency instead (20 chains in C gave 5.4 G VPDPBUSD a
second on Zen 5, where the instruction issues twice a cycle).

The mixed loops put one other instruction beside every two VPDPBUSD: where VPDPBUSD's rate drops,
that instruction takes the same pipes. An int8 tile folds each block's integer sums into float32
(a conversion, a multiply and one or two FMAs per 8 VPDPBUSD), so which of those share the pipes
bounds the tile below the VPDPBUSD rate.

    python bench/cpu_peaks.py                 # needs a C compiler and AVX512-VNNI/BF16
    python bench/cpu_peaks.py --iterations 5000000
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CLOBBERS = ", ".join(f'"zmm{i}"' for i in range(32))
# zmm29-31 hold the operands (set once); zmm0-23 are the chains.
SETUP = ('__asm__ volatile("vpternlogd $0xff, %%zmm31, %%zmm31, %%zmm31\\n\\t'
         'vpabsb %%zmm31, %%zmm30\\n\\tvxorps %%zmm29, %%zmm29, %%zmm29" ::: ' + CLOBBERS + ');')

ALONE = {"vpdpbusd": 24, "vdpbf16ps": 24, "vfmadd231ps": 24}
# Beside every two VPDPBUSD: (label, instruction with operands; {d} is its chain register).
BESIDE = [("fma", "vfmadd231ps %%zmm29, %%zmm29, %%zmm{d}"),
          ("mul", "vmulps %%zmm29, %%zmm{d}, %%zmm{d}"),
          ("add", "vaddps %%zmm29, %%zmm{d}, %%zmm{d}"),
          ("cvt (int32 -> float)", "vcvtdq2ps %%zmm29, %%zmm{d}"),
          ("scalef", "vscalefps %%zmm29, %%zmm{d}, %%zmm{d}"),
          ("paddd", "vpaddd %%zmm29, %%zmm{d}, %%zmm{d}")]


def _loop(name: str, lines: list[str], count: int) -> str:
    body = "\n".join(f'"{line}\\n\\t"' for line in lines)
    return (f'  {SETUP}\n  t = now();\n  for (long i = 0; i < n; i++) {{ __asm__ volatile(\n'
            f'{body}\n  ::: {CLOBBERS}); }}\n  dt = now() - t;\n'
            f'  printf("%s %.4f\\n", "{name}", {count}.0 * n / dt / 1e9);\n')


def c_source() -> str:
    """A program printing `name rate` lines: the clock in GHz (four dependent adds a loop), then
    G instructions a second per instruction alone and for VPDPBUSD beside each other one."""
    loops = []
    for instruction, chains in ALONE.items():
        loops.append(_loop(instruction, [f"{instruction} %%zmm30, %%zmm31, %%zmm{i}"
                                         for i in range(chains)], chains))
    for label, other in BESIDE:
        lines = []
        for i in range(16):
            lines.append(f"vpdpbusd %%zmm30, %%zmm31, %%zmm{i}")
            if i % 2:
                lines.append(other.format(d=16 + i // 2))
        loops.append(_loop(f"vpdpbusd+{label}", lines, 16))
    return ("#include <stdio.h>\n#include <stdlib.h>\n#include <time.h>\n"
            "static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);"
            " return t.tv_sec + t.tv_nsec * 1e-9; }\n"
            "int main(int argc, char** argv) {\n  long n = atol(argv[1]); double t, dt; long x = 1;\n"
            "  t = now();\n  for (long i = 0; i < 4 * n; i++) { __asm__ volatile("
            '"add $1, %0\\n\\tadd $1, %0\\n\\tadd $1, %0\\n\\tadd $1, %0" : "+r"(x)); }\n'
            '  dt = now() - t;\n  printf("clock %.4f\\n", 16.0 * n / dt / 1e9);\n'
            + "".join(loops) + "  return (int)(x & 1) * 0;\n}\n")


def cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(text.split())
    return all(flag in words for flag in flags)


def measure(iterations: int) -> dict[str, float]:
    """Compile and run the program once; its figures by name (G a second; the clock in GHz)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH: set CC")
    with tempfile.TemporaryDirectory(prefix="cpu-peaks-") as tmp:
        source, program = Path(tmp) / "peaks.c", Path(tmp) / "peaks"
        source.write_text(c_source())
        subprocess.run([compiler, "-O2", "-march=native", str(source), "-o", str(program)],
                       check=True)
        out = subprocess.run([str(program), str(iterations)], check=True, capture_output=True,
                             text=True).stdout
    return {name: float(value) for name, value in (line.rsplit(" ", 1)
                                                  for line in out.splitlines())}


def report(rates: dict[str, float], cores: int) -> str:
    clock = rates["clock"]
    per_op = {"vpdpbusd": 128, "vdpbf16ps": 64, "vfmadd231ps": 32}   # int ops / flops
    lines = [f"clock ~{clock:.2f} GHz (one core, four dependent adds a loop)"]
    for instruction, ops in per_op.items():
        rate = rates[instruction]
        lines.append(f"{instruction:<12} {rate:5.2f} G/s a core = {rate / clock:4.2f} a cycle: "
                     f"{rate * ops:6.0f} G ops/s a core, {rate * ops * cores:6.0f} for {cores}")
    lines.append("VPDPBUSD with one other instruction per two (a drop: the same pipes):")
    for label, _ in BESIDE:
        rate = rates[f"vpdpbusd+{label}"]
        lines.append(f"  beside {label:<22} {rate / clock:4.2f} VPDPBUSD a cycle")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50_000_000,
                        help="loop trips per figure (default 50,000,000: ~6 s in all)")
    args = parser.parse_args(argv)
    if not cpu_has("avx512_vnni", "avx512_bf16"):
        print("cpu_peaks: this CPU lacks AVX512-VNNI or AVX512-BF16; nothing to measure")
        return 0
    cores = len(os.sched_getaffinity(0))
    print(report(measure(args.iterations), cores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
