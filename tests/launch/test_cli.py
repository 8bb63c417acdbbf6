"""`spmdrun` (python -m launch) as a user runs it: generate, supervision, signals, bad input."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DUMMY = ("--model", "dummy:smollm2", "--num-kv-blocks", "16", "--max-model-len", "128")


def spmdrun(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "spmd_runtime.launch", *args], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", ""
        raise
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def engine_children_gone(procs, timeout_s: float = 15.0) -> list:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# ---------------------------------------------------------------------------- generate

@pytest.mark.timeout(360)
def test_generate_prints_only_the_answer() -> None:
    result = spmdrun("generate", "--model", "smollm2", "--prompt",
                     "What is the capital of France?", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 1, f"stdout should hold only the completion:\n{result.stdout}"
    assert "Paris" in lines[0]
    assert "INFO" not in result.stdout and "spmd" not in result.stdout
    assert "serving" in result.stderr, "logs belong on stderr"


@pytest.mark.timeout(360)
def test_generate_without_chat_template(hf_smollm2, greedy_reference) -> None:
    prompt = "The capital of France is"
    result = spmdrun("generate", "--model", "smollm2", "--prompt", prompt,
                     "--no-chat-template", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    model, tokenizer = hf_smollm2
    ids = list(tokenizer(prompt).input_ids)
    expected = greedy_reference.generate(model, ids, 8)
    eos = model.config.eos_token_id
    if eos in expected:
        expected = expected[:expected.index(eos) + 1]
    text = tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert result.stdout == text + "\n"
    assert "Paris" in result.stdout


# ---------------------------------------------------------------------------- supervision

@pytest.mark.timeout(240)
@pytest.mark.parametrize(("victim_module", "victim_name"),
                         [("worker_proc", "worker rank 0"), ("scheduler_proc", "scheduler")],
                         ids=["worker", "scheduler"])
def test_killed_engine_process_stops_the_whole_job(spmd_serve, victim_module: str,
                                                   victim_name: str) -> None:
    # Without restarts (a killed worker is otherwise replaced: see test_faults.py).
    server = spmd_serve(*DUMMY, "--max-restarts", "0")
    try:
        server.wait_serving()
        worker = server.child("worker_proc")
        scheduler = server.child("scheduler_proc")
        procs = server.processes()
        assert {p.pid for p in procs} >= {worker.pid, scheduler.pid}
        victim = worker if victim_module == "worker_proc" else scheduler
        victim.send_signal(signal.SIGKILL)
        assert server.proc.wait(30) != 0
        stderr = server.stderr
        assert f"{victim_name} (pid {victim.pid}) exited with code -9" in stderr, stderr[-2000:]
        assert engine_children_gone(procs) == [], "engine processes outlived the launcher"
    finally:
        server.kill_tree()


@pytest.mark.timeout(240)
def test_sigterm_stops_a_serving_launcher_cleanly(spmd_serve) -> None:
    server = spmd_serve(*DUMMY)
    try:
        server.wait_serving()
        procs = server.processes()
        assert len(procs) == 3, procs              # launcher, scheduler and one worker
        started = time.monotonic()
        assert server.terminate(timeout_s=30) == 0, server.stderr[-2000:]
        assert time.monotonic() - started < 30
        assert engine_children_gone(procs) == []
        assert "Traceback" not in server.stderr, server.stderr[-3000:]
    finally:
        server.kill_tree()


@pytest.mark.timeout(240)
def test_ctrl_c_stops_a_serving_launcher_quietly(free_port) -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the launcher,
    the scheduler and the workers. Everything stops, with no traceback."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "spmd_runtime.launch", "serve", *DUMMY, "--rpc-address",
                             address], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)         # its own process group
    procs = []
    try:
        deadline = time.monotonic() + 180
        while "serving" not in proc.stdout.readline():
            assert proc.poll() is None and time.monotonic() < deadline, "never served"
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        assert len(procs) == 3
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
        assert engine_children_gone(procs) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass


@pytest.mark.timeout(240)
def test_worker_that_fails_to_load_ends_the_job_with_its_error(tmp_path) -> None:
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": 64}')      # no weights, incomplete
    result = spmdrun("generate", "--model", str(bad), "--prompt", "hi", timeout_s=180)
    assert result.returncode != 0
    assert result.stdout == ""
    # The worker's own traceback is shown, then the launcher's one-line verdict.
    assert "rank 0 failed" in result.stderr and "num_attention_heads" in result.stderr, \
        result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("spmdrun: ") and "stopped the whole job" in last, last


# ---------------------------------------------------------------------------- bad input

def _watch_children(args: list[str]) -> tuple[subprocess.CompletedProcess, int, float]:
    """Run spmdrun, counting the child processes it ever has; returns (result, most, seconds)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "spmd_runtime.launch", *args], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    most = 0
    try:
        while proc.poll() is None and time.monotonic() - started < 60:
            try:
                most = max(most, len(psutil.Process(proc.pid).children(recursive=True)))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.01)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    return (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), most,
            time.monotonic() - started)


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--model", "smollm2", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "smollm2", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["generate", "--model", "smollm2", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["serve", "--max-num-seqs", "0"], "max_num_seqs"),
    (["serve", "--block-size", "abc"], "block-size"),
    (["generate", "--model", "smollm2"], "prompt"),
], ids=["temperature", "top_p", "max_tokens", "max_num_seqs", "not-an-int", "no-prompt"])
def test_bad_cli_input_exits_with_a_clear_message_and_starts_nothing(args, message) -> None:
    result, most_children, seconds = _watch_children(args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
    assert most_children == 0, "no engine process may start for bad input"
    assert seconds < 30


# ---------------------------------------------------------------------------- bench throughput

@pytest.mark.timeout(300)
def test_bench_throughput_uniform_output_lengths_with_the_transformers_peer() -> None:
    """A dummy preset through `bench throughput` with per-request output lengths and EOS ignored,
    then through transformers in the same invocation: each row's output tokens are the sum of
    the drawn lengths."""
    import json

    from spmd_runtime.launch.bench import ThroughputWorkload

    result = spmdrun("bench", "throughput", "--load-format", "dummy", "--model-config", "tiny-llama",
                     "--num-requests", "6", "--input-len-min", "8", "--input-len-max", "40",
                     "--output-len-min", "1", "--output-len-max", "12", "--seed", "3",
                     "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
                     "--max-model-len", "128", "--with-peer", "--peer-cache", "same", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    lens = ThroughputWorkload(6, 8, 40, 1, 12, seed=3).output_lens()
    assert len(set(lens)) > 1
    assert [row["engine"] for row in rows] == ["spmd-runtime", "transformers (sdpa)"]
    assert [row["output_tokens"] for row in rows] == [sum(lens)] * 2
    assert rows[0]["input_tokens"] == rows[1]["input_tokens"]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("engine") and lines[1].startswith("spmd-runtime")
    assert "workload: 6 requests, prompt lengths [8, 40], output lengths [1, 12], seed 3; " \
           "model dummy:tiny-llama" in result.stdout
    assert "output tok/s ratio (spmd-runtime / transformers):" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--output-len", "4", "--output-len-max", "9"], "not both"),
    (["--model", "smollm2", "--model-config", "tiny-llama"], "--model or --model-config"),
    (["--model-config", "llama-9b"], "invalid choice"),
], ids=["output-len-conflict", "model-conflict", "unknown-preset"])
def test_bad_bench_input_exits_with_a_clear_message_and_starts_nothing(args, message) -> None:
    result, most_children, _ = _watch_children(["bench", "throughput", *args])
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert most_children == 0, "no engine process may start for bad input"
