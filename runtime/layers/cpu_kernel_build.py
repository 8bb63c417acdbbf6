"""Builds the C++ CPU operators ahead of serving: one shared library per instruction-set level
(runtime/cpu_features.py KERNEL_LEVELS), each in a folder keyed by that level, the torch
version and a digest of the sources, so a library is never loaded on a CPU, a torch or sources
it was not built for. `make env` runs `python -m spmd_runtime.runtime.layers.cpu_kernel_build`;
a compiler error fails it with the compiler's own message.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spmd_runtime.runtime.cpu_features import KERNEL_LEVELS, detect

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("cpu_attention.cpp", "cpu_quantization.cpp", "cpu_layers.cpp",
                                    "cpu_decode_layers.cpp", "cpu_prompt_layers.cpp",
                                    "cpu_prefill_attention.cpp",
                                    "cpu_group_quant.cpp", "cpu_bf16_linear.cpp",
                                    "cpu_bf16_panels.cpp")]
# Every header beside the sources, so that a new one is never left out of the digest.
HEADERS = sorted(HERE.glob("cpu_*.h"))
LIBRARY = "libspmd_cpu_ops.so"
DEFAULT_ROOT = HERE / "_kernels"


class KernelBuildError(RuntimeError):
    """The compiler refused the sources: the message carries its output."""


def source_digest() -> str:
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def library_path(level: str, torch_version: str, root: Path = DEFAULT_ROOT) -> Path:
    return root / f"{level}-torch{torch_version}-{source_digest()}" / LIBRARY


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags for a library against the running torch's C++ API."""
    import torch
    from torch.utils import cpp_extension
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    includes.append(f"-isystem{sysconfig.get_path('include')}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = cpp_extension.library_paths()
    link = [f"-L{path}" for path in libs] + [f"-Wl,-rpath,{path}" for path in libs]
    return ([*includes, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-std=c++20", "-fPIC", "-O3",
             "-fopenmp"], [*link, *loaded_libstdcxx(), "-lc10", "-ltorch_cpu", "-ltorch",
                           "-fopenmp", "-shared"])


def loaded_libstdcxx(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The shared C++ runtime this process runs (torch loaded it), named by its path, so the
    library links to it. Where the compiler finds only libstdc++.a (a toolchain without the
    libstdc++.so link: seen on a GPU host), g++ would copy the C++ runtime into the library;
    that copy's locale facets do not match the process's, and formatting a number (every
    TORCH_CHECK message) crashed the interpreter. [] where /proc tells nothing."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    found = sorted({line.split()[-1] for line in lines if "/libstdc++.so" in line})
    return found[:1]


# A symbol of the C++ runtime's own code (std::ostream::_M_insert<long>): a library that
# defines it carries a copy of libstdc++ (see loaded_libstdcxx).
LIBSTDCXX_CODE = "_ZNSo9_M_insertIlEERSoT_"


def check_runtime_not_copied(library: Path) -> None:
    """Refuse a library that defines the C++ runtime's own code; skipped where there is no
    `nm` to read its symbols with."""
    nm = shutil.which("nm")
    if nm is None:
        return
    done = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True,
                          text=True)
    if done.returncode == 0 and LIBSTDCXX_CODE in done.stdout.split():
        raise KernelBuildError(
            f"{library.name} links a static copy of libstdc++ (it defines {LIBSTDCXX_CODE}), "
            "which crashes formatting numbers: install the compiler's libstdc++ development "
            "files (libstdc++-N-dev) so that g++ finds libstdc++.so, and build again")


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise KernelBuildError(f"{' '.join(command[:1] + command[-3:])} failed:\n"
                               f"{done.stdout}{done.stderr}")


def build(level: str, root: Path = DEFAULT_ROOT, jobs: int | None = None) -> Path:
    """Compile the library for `level` (if not built for these sources already); its path."""
    import torch
    target = library_path(level, torch.__version__, root)
    if target.exists():
        return target
    compile_flags, link_flags = _torch_flags()
    compiler = os.environ.get("CXX", "g++")
    level_flags = list(KERNEL_LEVELS[level][0])
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{level}-") as scratch:
        objects = [Path(scratch) / (source.stem + ".o") for source in SOURCES]
        with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            list(pool.map(_run, [[compiler, *compile_flags, *level_flags, "-c", str(source),
                                  "-o", str(obj)] for source, obj in zip(SOURCES, objects, strict=True)]))
        staged = Path(scratch) / LIBRARY
        _run([compiler, *map(str, objects), *link_flags, "-o", str(staged)])
        check_runtime_not_copied(staged)
        if library_path(level, torch.__version__, root) != target:
            raise KernelBuildError("the sources changed while they were compiled: nothing was "
                                   "installed; build again")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, target)
    return target


def levels_to_build(which: str) -> list[str]:
    """"native": the most capable level this CPU runs; "all": every level; or a comma list."""
    if which == "native":
        runnable = detect().kernel_levels
        return runnable[:1]
    if which == "all":
        return list(KERNEL_LEVELS)
    levels = [name.strip() for name in which.split(",") if name.strip()]
    unknown = [name for name in levels if name not in KERNEL_LEVELS]
    if unknown:
        raise ValueError(f"unknown kernel level(s) {unknown}: use native, all or a comma list of "
                         f"{', '.join(KERNEL_LEVELS)}")
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="spmdrun build-kernels", description="Build the C++ CPU operators ahead of serving.",
        allow_abbrev=False)
    parser.add_argument("--levels", default="native",
                        help="native (this CPU's best level), all, or a comma list of "
                        f"{', '.join(KERNEL_LEVELS)} (default: native)")
    parser.add_argument("--clean", action="store_true",
                        help="remove every earlier build first (other torch versions, sources)")
    args = parser.parse_args(argv)
    try:
        levels = levels_to_build(args.levels)
    except ValueError as error:
        parser.error(str(error))
    if not levels:
        print("build-kernels: this CPU has no AVX2 (with FMA and F16C): nothing to build; "
              "CPU workers run the torch paths", file=sys.stderr)
        return 0
    if args.clean and DEFAULT_ROOT.exists():
        shutil.rmtree(DEFAULT_ROOT)
    for level in levels:
        try:
            path = build(level)
        except KernelBuildError as error:
            print(f"build-kernels: the {level} build failed: {error}", file=sys.stderr)
            return 1
        print(f"build-kernels: {level}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
