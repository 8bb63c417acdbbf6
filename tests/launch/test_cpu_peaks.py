"""bench/cpu_peaks.py: its generated programs build and report every figure they promise, each a
rate a core could plausibly issue (no figure is asserted against a timing)."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cpu_peaks.py"


def _module():
    spec = importlib.util.spec_from_file_location("cpu_peaks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_program_has_independent_chains():
    """Every chain a loop names is a register of its own: chains sharing a register would
    measure the instruction's latency, as 20 chains written in C did."""
    source = _module().c_source()
    for loop in source.split("__asm__ volatile(\n")[1:]:
        body = loop.split(":::")[0]
        targets = re.findall(r"%%zmm(\d+)\\n", body)
        assert len(targets) == len(set(targets)) >= 16
        assert not {"29", "30", "31"} & set(targets)    # the operands are never written


def test_report_names_every_figure():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    run = subprocess.run([sys.executable, str(SCRIPT), "--iterations", "2000000",
                          "--bandwidth-mib", "64"],
                         capture_output=True, text=True, timeout=120, check=True)
    if not _module().cpu_has("avx512_vnni", "avx512_bf16"):
        assert "nothing to measure" in run.stdout
        return
    per_cycle = dict(re.findall(r"^(\w+)\s.* = ([\d.]+) a cycle", run.stdout, re.M))
    assert set(per_cycle) == {"vpdpbusd", "vdpbf16ps", "vfmadd231ps"}
    beside = re.findall(r"beside (.+?)\s+([\d.]+) VPDPBUSD a cycle", run.stdout)
    assert [label for label, _ in beside] == [label for label, _ in _module().BESIDE]
    for rate in [*per_cycle.values(), *(rate for _, rate in beside)]:
        assert 0.1 < float(rate) < 8
    reads = re.findall(r"^memory read, (\d+) threads?: ([\d.]+) GB/s", run.stdout, re.M)
    assert reads and reads[0][0] == "1" and all(float(rate) > 0 for _, rate in reads)
