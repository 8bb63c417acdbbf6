"""One installed namespace: the engine's packages live under spmd_runtime, so a user's own
protocol.py, runtime.py or launch.py next to their script shadows nothing."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHADOWS = ("protocol", "runtime", "launch", "scheduler_proc", "worker_proc")


@pytest.mark.timeout(300)
def test_user_modules_named_like_the_folders_do_not_break_the_engine(tmp_path: Path) -> None:
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py')\n")
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        from spmd_runtime.runtime import LLM, SamplingParams

        with LLM("dummy:tiny-llama", max_model_len=64, kv_cache_memory="8MiB") as llm:
            (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        print("tokens", len(out.token_ids))
    """))
    # Run from the user's directory: it comes first on sys.path, for this process and for the
    # engine processes it starts (they inherit the working directory).
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, stdin=subprocess.DEVNULL, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens 3" in result.stdout
    assert "the user's own" not in result.stderr
