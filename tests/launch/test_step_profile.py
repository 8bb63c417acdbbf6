"""bench/step_profile.py: it sizes the runner's KV cache to the steps it hands out (its decode
batch and prefills, twice over with --trace), refuses a --num-kv-blocks below that with a line
naming the option, and reports both step kinds (no figure is asserted against a timing)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "step_profile.py"
SMALL = ["--model", "dummy:tiny-llama", "--batch", "4", "--context", "40", "--prefill-tokens",
         "30", "--steps", "2"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *SMALL, *args], capture_output=True,
                          text=True, timeout=300)


def test_too_few_blocks_is_refused_naming_what_the_steps_take() -> None:
    # 4 requests of 40 + 64 tokens (7 blocks each), 3 prefills of 30 + 64 (6 each), block 0.
    done = run("--num-kv-blocks", "46")
    assert done.returncode == 2
    assert "--num-kv-blocks 46 is too few" in done.stderr and "take 47" in done.stderr


def test_the_default_cache_holds_every_step_with_the_trace_too() -> None:
    # With --trace: 2 x 4 x 7 + 4 x 6 + 1 = 81 blocks, past the untraced 47.
    done = run("--trace")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "decode step, batch 4, context ~40" in done.stdout
    assert "prefill step, 30 tokens" in done.stdout and "prefill step (30 tokens):" in done.stdout
