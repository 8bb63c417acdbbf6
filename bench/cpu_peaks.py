"""What one core of this CPU can issue: clock, dot-product rates, which ops share their pipes; and
the memory's read bandwidth.

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

The read bandwidth (one thread, then one a core) is what memory-bound work is held to: a decode
step's attention reads every running request's keys and values.

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
            + "".join(loops) + "  (void)x;\n  return 0;\n}\n")


BANDWIDTH_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  size_t n = (size_t)atol(argv[1]) << 20;
  char* p = aligned_alloc(4096, n);   /* n: whole MiB, so a multiple of the alignment */
  if (p == NULL) { fprintf(stderr, "cannot allocate %zu bytes\n", n); return 1; }
  for (size_t i = 0; i < n; i += 4096) p[i] = 1;
  for (int threads = 1; threads <= omp_get_max_threads(); threads += omp_get_max_threads() - 1) {
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
      double t = now();
      long long total = 0;
      #pragma omp parallel num_threads(threads) reduction(+ : total)
      {
        size_t part = n / threads;
        const char* q = p + omp_get_thread_num() * part;
        __m512i acc = _mm512_setzero_si512();
        for (size_t i = 0; i + 256 <= part; i += 256)
          acc = _mm512_add_epi64(_mm512_add_epi64(acc, _mm512_load_si512(q + i)),
                _mm512_add_epi64(_mm512_add_epi64(_mm512_load_si512(q + i + 64),
                _mm512_load_si512(q + i + 128)), _mm512_load_si512(q + i + 192)));
        total += _mm512_reduce_add_epi64(acc);
      }
      double rate = n / (now() - t) / 1e9;
      if (rate > best) best = rate;
      if (total == 42) puts("");
    }
    printf("read-%d %.4f\n", threads, best);
    if (omp_get_max_threads() == 1) break;
  }
  return 0;
}
"""


def cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(text.split())
    return all(flag in words for flag in flags)


def _compile_and_run(source: str, argument: int, flags: list[str]) -> dict[str, float]:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH: set CC")
    with tempfile.TemporaryDirectory(prefix="cpu-peaks-") as tmp:
        path, program = Path(tmp) / "peaks.c", Path(tmp) / "peaks"
        path.write_text(source)
        subprocess.run([compiler, "-O2", "-march=native", *flags, str(path), "-o", str(program)],
                       check=True)
        out = subprocess.run([str(program), str(argument)], check=True, capture_output=True,
                             text=True).stdout
    return {name: float(value) for name, value in (line.rsplit(" ", 1)
                                                  for line in out.splitlines() if line)}


def measure(iterations: int, bandwidth_mib: int = 512) -> dict[str, float]:
    """Compile and run the programs; their figures by name (G a second; the clock in GHz; the
    read bandwidth in GB/s over a buffer of bandwidth_mib MiB, 0 for none)."""
    rates = _compile_and_run(c_source(), iterations, [])
    if bandwidth_mib:
        rates |= _compile_and_run(BANDWIDTH_SOURCE, bandwidth_mib, ["-fopenmp"])
    return rates


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
    for name in sorted(n for n in rates if n.startswith("read-")):
        threads = int(name.split("-")[1])
        lines.append(f"memory read, {threads} thread{'s' * (threads > 1)}: {rates[name]:.1f} GB/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50_000_000,
                        help="loop trips per figure (default 50,000,000: ~1 s in all)")
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="buffer the read bandwidth is measured over (0: skip it)")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.bandwidth_mib < 0:
        parser.error("--iterations must be >= 1 and --bandwidth-mib >= 0")
    if not cpu_has("avx512_vnni", "avx512_bf16"):
        print("cpu_peaks: this CPU lacks AVX512-VNNI or AVX512-BF16; nothing to measure")
        return 0
    cores = len(os.sched_getaffinity(0))
    print(report(measure(args.iterations, args.bandwidth_mib), cores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
