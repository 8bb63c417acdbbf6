"""`spmdrun` (python -m launch) as a user runs it: generate, supervision, signals, bad input."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import repo_pythonpath
from spmd_runtime.launch.cli import build_parser, parse_command_line, subcommand_parsers
from spmd_runtime.launch.commands import answer_line
from spmd_runtime.launch.help_format import ADVANCED_FIELDS
from spmd_runtime.launch.options import config_from_args, prompts_from_args, token_warnings
from spmd_runtime.protocol.config import OPTION_GROUPS, engine_config_fields
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.preflight import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
DUMMY = ("--model", "dummy:smollm2", "--num-kv-blocks", "16", "--max-model-len", "128")


def _run_to_end(argv: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """Run argv to its end; on a timeout (or any failure) kill it and its children."""
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_pythonpath(env)
    return env


def spmdrun(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    return _run_to_end([sys.executable, "-m", "spmd_runtime.launch", *args], _env(), timeout_s)


def engine_children_gone(procs, timeout_s: float = 15.0) -> list:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# ---------------------------------------------------------------------------- generate

@pytest.mark.timeout(360)
def test_generate_prints_only_the_answer() -> None:
    """Assertion on float32's answer: on a CPU with bf16 units `--dtype auto` is bfloat16, where
    the first token of this answer is a near-tie ("The" 25.33 against "L" 25.24 in float32) that
    rounding may turn to "L'Étoile, ..."."""
    result = spmdrun("generate", "--model", "smollm2", "--prompt",
                     "What is the capital of France?", "--max-tokens", "24", "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 1, f"stdout should hold only the completion:\n{result.stdout}"
    assert "Paris" in lines[0]
    assert "INFO" not in result.stdout and "spmd" not in result.stdout
    assert "serving" in result.stderr, "logs belong on stderr"


@pytest.mark.timeout(360)
def test_generate_without_chat_template(hf_smollm2, greedy_reference) -> None:
    """float32: the completion equals the reference's exactly. In bfloat16 its sixth token is a
    near-tie that rounding decides (float32 logits: " answer" 14.62 against " United" 14.40)."""
    prompt = "The capital of France is"
    result = spmdrun("generate", "--model", "smollm2", "--prompt", prompt,
                     "--no-chat-template", "--max-tokens", "8", "--dtype", "float32")
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
    env["PYTHONPATH"] = repo_pythonpath(env)
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
def test_worker_that_fails_to_load_ends_the_job_with_its_error(weightless_model_dir) -> None:
    # A config the launcher reads fine, but no weights: only the worker finds out.
    bad = weightless_model_dir
    result = spmdrun("generate", "--model", str(bad), "--prompt", "hi", timeout_s=180)
    assert result.returncode != 0
    assert result.stdout == ""
    # The worker's error ends the job, in the launcher's one-line verdict.
    assert "rank 0" in result.stderr and "safetensors" in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("spmdrun: ") and "stopped the whole job" in last, last


# ---------------------------------------------------------------------------- bad input

# Runs the launcher with an audit hook that appends a line to the file named by
# SPMD_TEST_SPAWN_LOG for every process it starts (subprocess, fork, exec, spawn, system) before
# starting it: a child that lives a millisecond is seen as surely as one that lives a minute.
_SPAWN_WATCH = """\
import os, runpy, sys
_log = os.environ.pop("SPMD_TEST_SPAWN_LOG")
_events = ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
           "os.system", "pty.spawn")
def _hook(event, args):
    if event in _events:
        with open(_log, "a") as f:
            f.write(event + " " + repr(args)[:300] + "\\n")
sys.addaudithook(_hook)
runpy.run_module("spmd_runtime.launch", run_name="__main__", alter_sys=True)
"""


def _watch_children(args: list[str]) -> tuple[subprocess.CompletedProcess, int, float]:
    """Run spmdrun to its end, waiting on its exit; returns (result, number of processes it
    started, seconds)."""
    env = _env()
    with tempfile.TemporaryDirectory() as scratch:
        spawn_log = Path(scratch) / "spawned"
        spawn_log.touch()
        env["SPMD_TEST_SPAWN_LOG"] = str(spawn_log)
        started = time.monotonic()
        result = _run_to_end([sys.executable, "-c", _SPAWN_WATCH, *args], env, 90)
        spawned = spawn_log.read_text().splitlines()
    if spawned:
        print("spmdrun started processes:", *spawned, sep="\n")     # shown if the test fails
    return result, len(spawned), time.monotonic() - started


def assert_one_line_error(result: subprocess.CompletedProcess, most_children: int,
                          message: str) -> None:
    """A user error: exit code 2, one line on stderr saying what to change, no traceback, and
    no engine process ever started (so no weights were loaded)."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spmdrun: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert most_children == 0, "no engine process may start for bad input"


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--model", "smollm2", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "smollm2", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["generate", "--model", "smollm2", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["serve", "--max-num-seqs", "0"], "invalid --max-num-seqs: expected int >= 1, got 0"),
    (["serve", "--block-size", "abc"], "argument --block-size: invalid int value: 'abc'"),
    (["generate", "--model", "smollm2"], 'give a prompt: spmdrun generate "PROMPT"'),
    # Issue 19's findings, each once found only after loading, or as a traceback:
    (["generate", "hi", "--dtype", "fp16"],
     "argument --dtype: invalid choice: 'fp16' (choose from 'auto', 'float32', 'float16', "
     "'bfloat16')"),
    (["serve", "--model", "/no/such/model-dir"], "model path not found: '/no/such/model-dir': "
     "check the path of --model"),
    (["serve", "--model", "/no/such/model.gguf"], "GGUF file not found: '/no/such/model.gguf'"),
    (["generate", "--model", "meta-llama/Llama-3.2-1B", "hi"],
     "nothing is downloaded: pass a local .gguf file or directory"),
    (["serve", "--model", "dummy:tiny-llama", "--nproc-per-node", "3"],
     "use a tensor-parallel size (-tp) of 1, 2, 4"),
    (["serve", "--model", "dummy:tiny-llama", "-tp", "3"], "tensor-parallel size 3 must divide"),
    (["generate", "--prompt-file", "/no/such/prompts.txt"],
     "--prompt-file /no/such/prompts.txt: No such file or directory"),
    (["serve", "--log-level", "verbose"], "argument --log-level: invalid choice: 'verbose'"),
    (["serve", "--max-num-seq", "4"], "unrecognized option --max-num-seq: did you mean "
     "--max-num-seqs?"),
    (["generate", "hi", "--http-port", "8000"], "`spmdrun generate` has no option --http-port "
     "(it is one of `spmdrun serve`, `spmdrun bench serving`)"),
    (["generate", "--model", "dummy:tiny-llama", "hi"], "no tokenizer"),
], ids=["temperature", "top_p", "max_tokens", "max_num_seqs", "not-an-int", "no-prompt",
        "dtype", "model-path", "gguf-path", "hub-id", "tp-size", "tp-alias", "prompt-file",
        "log-level", "abbreviation", "server-flag-in-generate", "no-tokenizer"])
def test_bad_cli_input_exits_with_one_line_and_starts_nothing(args, message) -> None:
    result, most_children, _ = _watch_children(args)
    assert_one_line_error(result, most_children, message)


@pytest.mark.parametrize("flag", ["--rpc-address", "--port"])
def test_a_port_in_use_is_refused_before_loading(flag) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        value = f"tcp://127.0.0.1:{port}" if flag == "--rpc-address" else str(port)
        result, most_children, _ = _watch_children(["serve", "--model", "dummy:tiny-llama",
                                                    flag, value])
    option = "--rpc-address" if flag == "--rpc-address" else "--http-port"
    assert_one_line_error(result, most_children, f"{option} {value}: port {port} is already in "
                          "use on this machine")


def test_log_level_debug_shows_the_traceback_of_a_user_error() -> None:
    result, most_children, _ = _watch_children(["serve", "--log-level", "debug", "--model",
                                                "/no/such/model.gguf"])
    assert result.returncode == 2 and most_children == 0
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("spmdrun: error: GGUF file")


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


# ---------------------------------------------------------------------------- the options

def _config(*argv: str):
    return config_from_args(parse_command_line(build_parser(), list(argv)))


def test_serve_help_is_grouped_and_generate_has_no_server_options() -> None:
    result = spmdrun("serve", "--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    for title in OPTION_GROUPS:
        assert f"\n{title}:\n" in result.stdout, title
    assert "--tensor-parallel-size" in result.stdout and "--api-key" in result.stdout
    generate = subcommand_parsers(build_parser())["generate"].format_help()
    for flag in ("--http-port", "--port", "--rpc-address", "--enable-admin", "--admin-token",
                 "--served-model-name", "--max-message-bytes", "\nserving & network:"):
        assert flag not in generate, flag
    for flag in ("--max-tokens MAX_TOKENS", "--top-p TOP_P", "--top-k TOP_K"):
        entry = generate[generate.index(flag):]
        assert "(default: " in entry[:entry.index("\n  --")], flag


def test_no_parser_accepts_abbreviations() -> None:
    parser = build_parser()
    parsers = [parser, *subcommand_parsers(parser).values()]
    assert len(parsers) == 10 and not any(p.allow_abbrev for p in parsers)


def test_vllm_spellings_set_the_engine_fields() -> None:
    config = _config("serve", "--host", "127.0.0.2", "--port", "8001", "--api-key", "k",
                     "--served-model-name", "m", "-tp", "2")
    assert (config.http_host, config.http_port, config.auth_token, config.served_model_name,
            config.nproc_per_node) == ("127.0.0.2", 8001, "k", "m", 2)
    # -tp is the total over all nodes.
    config = _config("--nnodes", "2", "--master-port", "29500", "serve",
                     "--tensor-parallel-size", "4")
    assert (config.nproc_per_node, config.nnodes, config.world_size) == (2, 2, 4)
    for argv, message in [(("--nnodes", "2", "serve", "-tp", "3"), "multiple of --nnodes 2"),
                          (("serve", "-tp", "4", "--nproc-per-node", "2"), "disagree")]:
        with pytest.raises(ConfigError, match=message):
            _config(*argv)


def test_launcher_options_before_or_after_the_command() -> None:
    before = _config("--nproc-per-node", "2", "--master-port", "29501", "serve")
    after = _config("serve", "--nproc-per-node", "2", "--master-port", "29501")
    assert before == after and before.nproc_per_node == 2 and before.master_port == 29501
    assert _config("generate", "hi", "--nnodes", "1", "--node-rank", "0").world_size == 1


def test_prompts_positional_and_as_options(tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("from a file\n\n")
    args = parse_command_line(build_parser(), ["generate", "What is 2+2?", "--max-tokens", "8",
                                               "Name a prime.", "--prompt", "third",
                                               "--prompt-file", str(prompts)])
    assert prompts_from_args(args, "smollm2") == ["What is 2+2?", "Name a prime.", "third",
                                                  "from a file"]


def test_tokens_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("SPMD_API_KEY", "from-env")
    monkeypatch.setenv("SPMD_ADMIN_TOKEN", "admin-from-env")
    args = parse_command_line(build_parser(), ["serve", "--enable-admin"])
    config = config_from_args(args)
    assert (config.auth_token, config.admin_token) == ("from-env", "admin-from-env")
    assert config.enable_admin
    assert token_warnings(args) == []
    args = parse_command_line(build_parser(), ["serve", "--api-key", "s3cret-on-argv"])
    assert config_from_args(args).auth_token == "s3cret-on-argv"
    [warning] = token_warnings(args)
    assert "visible to other users" in warning and "SPMD_API_KEY" in warning
    assert "s3cret" not in warning


def test_answer_lines() -> None:
    output = RequestOutput(7, [1, 2], token_ids=[5, 6], text=" Four. ", finish_reason="stop")
    assert answer_line("text", 0, ["2+2?"], output) == "Four."
    assert answer_line("text", 1, ["a", "2+2?"], output) == "[1] Four."
    assert json.loads(answer_line("jsonl", 1, ["a", "2+2?"], output)) == {
        "index": 1, "prompt": "2+2?", "text": " Four. ", "token_ids": [5, 6],
        "finish_reason": "stop"}


@pytest.mark.timeout(360)
def test_generate_prints_json_lines_for_scripts() -> None:
    prompts = ["What is the capital of France?", "Name a prime number."]
    # float32: "Paris" below is float32's answer (see test_generate_prints_only_the_answer).
    result = spmdrun("generate", "--model", "smollm2", *prompts, "--max-tokens", "12",
                     "--output", "jsonl", "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.startswith("spmdrun: loading model smollm2 …\n"), result.stderr[:500]
    answers = sorted((json.loads(line) for line in result.stdout.splitlines()),
                     key=lambda answer: answer["index"])
    assert [(a["index"], a["prompt"]) for a in answers] == list(enumerate(prompts))
    assert all(a["finish_reason"] in ("stop", "length") and 0 < len(a["token_ids"]) <= 12
               for a in answers)
    assert "Paris" in answers[0]["text"]


def help_flags(argv: list[str], capsys) -> set[str]:
    """The options a help text lists (the first spelling of each)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    return set(re.findall(r"^  (-{1,2}[\w-]+)", capsys.readouterr().out, re.M))


def test_serve_help_lists_at_most_45_options_and_help_all_lists_every_one(capsys) -> None:
    shown = help_flags(["serve", "--help"], capsys)
    assert len(shown) <= 45, sorted(shown)
    every = help_flags(["serve", "--help-all"], capsys)
    fields = {"--" + name.replace("_", "-") for name, *_ in engine_config_fields()}
    assert fields - {"--config-json"} <= every
    assert every - shown == {"--" + name.replace("_", "-") for name in ADVANCED_FIELDS}
