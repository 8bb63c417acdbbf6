"""bench/bf16_panels_ab.py: both modes run and report each comparison they promise (no figure is
asserted against a timing)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from cpu_library import needs_bf16_tiles
from spmd_runtime.runtime.layers import bf16_panels

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bf16_panels_ab.py"
RATIO = r"oneDNN +[\d.]+ ms, panels +[\d.]+ ms, ratio [\d.]+"


def run(*args: str) -> str:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, check=True).stdout


@needs_bf16_tiles
def test_products_report_every_shape_and_row_count() -> None:
    out = run("products", "--shapes", "64x32,32x64", "--rows", "1,13", "--layers", "2",
              "--rounds", "1")
    for shape in ("64x32", "32x64"):
        for rows in (1, 13):
            assert re.search(rf"{shape} rows +{rows}: {RATIO}", out), out


@needs_bf16_tiles
def test_engine_reports_decode_and_prefill_where_the_panels_hold_weights() -> None:
    args = ("engine", "--model", "dummy:tiny-llama", "--batch", "2", "--context", "16",
            "--prompt", "32", "--decode-steps", "1", "--rounds", "1", "--kv-blocks", "64")
    if bf16_panels.AMX:     # oneDNN keeps every weight on AMX: the script says so and stops
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode != 0 and "no projection was held as panels" in done.stderr
        return
    out = run(*args)
    assert re.search(rf"decode step \(2 requests\): {RATIO}", out), out
    assert re.search(rf"prefill step \(32 tokens\): {RATIO}", out), out
