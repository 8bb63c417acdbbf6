"""CPU detection (runtime/cpu_features.py): the kernel build a CPU loads and the dtype that
--dtype auto resolves to, with the CPU's flags given (mocked) rather than read off this VM."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.cpu_features import CpuFeatures, parse_cpuinfo, resolve_dtype_name
from spmd_runtime.runtime.layers import cpu_kernel_build, cpu_ops
from spmd_runtime.worker_proc import worker

AVX2 = "fpu sse sse2 avx fma f16c avx2 bmi2"
AVX512 = AVX2 + " avx512f avx512bw avx512vl avx512dq avx512_vnni"
AVX512_BF16 = AVX512 + " avx512_bf16"
AMX = AVX512_BF16 + " amx_tile amx_bf16 amx_int8"


def cpu(flags: str) -> CpuFeatures:
    return parse_cpuinfo(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n"
                         f"processor\t: 1\nflags\t\t: {flags}\n")


def test_cpuinfo_gives_the_flags_and_the_kernel_levels_a_cpu_runs() -> None:
    assert cpu(AMX).model == "Test CPU"
    assert cpu(AMX).kernel_levels == ["amx", "avx512bf16", "avx512vnni", "avx512", "avx2"]
    assert cpu(AVX512_BF16).kernel_levels == ["avx512bf16", "avx512vnni", "avx512", "avx2"]
    assert cpu(AVX512).kernel_levels == ["avx512vnni", "avx512", "avx2"]
    assert cpu(AVX512.replace(" avx512_vnni", "")).kernel_levels == ["avx512", "avx2"]
    assert cpu(AVX2).kernel_levels == ["avx2"]
    assert cpu("fpu sse sse2 avx").kernel_levels == []


@pytest.mark.parametrize(("flags", "expected"), [(AMX, "bfloat16"), (AVX512_BF16, "bfloat16"),
                                                 (AVX512, "float32"), (AVX2, "float32")])
def test_auto_is_bfloat16_only_where_the_cpu_computes_it(flags, expected) -> None:
    dtype, why = resolve_dtype_name("auto", "cpu", cpu(flags))
    assert dtype == expected
    assert ("AMX" in why or "AVX512-BF16" in why)


def test_an_explicit_dtype_is_kept_and_cuda_auto_is_bfloat16() -> None:
    assert resolve_dtype_name("float32", "cpu", cpu(AMX)) == ("float32", "asked for with --dtype")
    assert resolve_dtype_name("bfloat16", "cpu", cpu(AVX2))[0] == "bfloat16"
    assert resolve_dtype_name("auto", "cuda", cpu(AVX2))[0] == "bfloat16"


def test_a_worker_resolves_auto_from_the_detected_cpu(monkeypatch) -> None:
    """The worker's own resolution, with detection mocked as an AVX2-only CPU and as AMX."""
    monkeypatch.setattr(cpu_features, "detect", lambda: cpu(AVX2))
    assert worker.resolve_dtype("auto", torch.device("cpu"))[0] == torch.float32
    monkeypatch.setattr(cpu_features, "detect", lambda: cpu(AMX))
    assert worker.resolve_dtype("auto", torch.device("cpu"))[0] == torch.bfloat16
    assert worker.resolve_dtype("float32", torch.device("cpu"))[0] == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        worker.resolve_dtype("float8", torch.device("cpu"))


def test_a_cpu_loads_its_best_built_level_and_a_missing_build_names_the_command(tmp_path) -> None:
    version = "9.9.9"
    missing = cpu_ops.find_library(cpu(AMX), tmp_path, version)
    assert missing.path is None and "spmdrun build-kernels" in missing.missing
    assert "amx" in missing.missing
    avx2 = cpu_kernel_build.library_path("avx2", version, tmp_path)
    avx2.parent.mkdir(parents=True)
    avx2.write_bytes(b"")
    assert cpu_ops.find_library(cpu(AMX), tmp_path, version).level == "avx2"
    assert cpu_ops.find_library(cpu(AVX2), tmp_path, version).path == avx2
    amx = cpu_kernel_build.library_path("amx", version, tmp_path)
    amx.parent.mkdir(parents=True)
    amx.write_bytes(b"")
    assert cpu_ops.find_library(cpu(AMX), tmp_path, version).level == "amx"
    assert cpu_ops.find_library(cpu(AVX2), tmp_path, version).level == "avx2"
    assert cpu_ops.find_library(cpu(AVX2), tmp_path, "other").path is None
    assert "no AVX2" in cpu_ops.find_library(cpu("sse2"), tmp_path, version).missing


def test_builds_are_keyed_by_the_sources(tmp_path, monkeypatch) -> None:
    """An edited source (or header) is a different build folder: a stale library never loads."""
    before = cpu_kernel_build.library_path("avx2", "1", tmp_path)
    header = tmp_path / "cpu_math.h"
    header.write_text("// edited\n")
    monkeypatch.setattr(cpu_kernel_build, "HEADERS", [header])
    assert cpu_kernel_build.library_path("avx2", "1", tmp_path) != before


def test_every_header_the_sources_include_is_in_the_digest() -> None:
    """A header edited must make a new build: each `#include "..."` of the library's sources
    and headers names one of HEADERS (an included header left out once kept a stale build)."""
    import re
    included = {name for path in cpu_kernel_build.SOURCES + cpu_kernel_build.HEADERS
                for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included and included <= {path.name for path in cpu_kernel_build.HEADERS}


def test_build_levels_and_a_bad_level_says_which_exist() -> None:
    assert cpu_kernel_build.levels_to_build("all") == ["amx", "avx512bf16", "avx512vnni", "avx512",
                                                       "avx2"]
    assert cpu_kernel_build.levels_to_build("avx2,avx512") == ["avx2", "avx512"]
    with pytest.raises(ValueError, match="amx, avx512bf16, avx512vnni, avx512, avx2"):
        cpu_kernel_build.levels_to_build("avx9")


def test_this_machine_loaded_a_prebuilt_library_without_compiling() -> None:
    """make env built the library for this CPU; loading it compiles nothing (no build folder of
    torch's JIT builder is made) and it is the build for this CPU's best level."""
    library = cpu_ops.loaded()
    assert library.path is not None, library.missing
    assert library.level == cpu_features.detect().kernel_levels[0]
    assert cpu_kernel_build.DEFAULT_ROOT in library.path.parents


def test_the_library_links_the_processes_shared_cpp_runtime(tmp_path) -> None:
    """The link names the libstdc++.so this process runs: a g++ that finds only libstdc++.a
    would otherwise copy the runtime into the library (it crashed formatting numbers)."""
    maps = tmp_path / "maps"
    maps.write_text("7f0-7f1 r-xp 0 08:01 5 /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33\n"
                    "7f2-7f3 r-xp 0 08:01 6 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert cpu_kernel_build.loaded_libstdcxx(maps) == ["/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"]
    assert cpu_kernel_build.loaded_libstdcxx(tmp_path / "absent") == []
    _, link = cpu_kernel_build._torch_flags()
    assert any("libstdc++.so" in flag for flag in link)


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None,
                    reason="needs g++ and nm")
def test_a_library_carrying_a_static_cpp_runtime_is_refused(tmp_path) -> None:
    source = tmp_path / "number.cpp"
    source.write_text('#include <sstream>\n#include <string>\n'
                      'std::string number(long n) { std::ostringstream s; s << n; return s.str(); }\n')
    shared, static = tmp_path / "shared.so", tmp_path / "static.so"
    for target, extra in ((shared, []), (static, ["-static-libstdc++"])):
        subprocess.run(["g++", "-shared", "-fPIC", *extra, str(source), "-o", str(target)],
                       check=True)
    cpu_kernel_build.check_runtime_not_copied(shared)
    with pytest.raises(cpu_kernel_build.KernelBuildError, match="static copy of libstdc"):
        cpu_kernel_build.check_runtime_not_copied(static)
