"""A job that cannot start ends at once, with the real error: the process that failed and its own
one-line reason as the launcher's last line, exit code 2 for a mistake the user can fix, no
traceback, no worker-group restart (restarts are for workers dying while serving)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest
from conftest import PROC_TAG_ENV, REPO_ROOT, free_tcp_port, kill_tree, wait_until_gone
from spmd_runtime.launch.running import RunningEngine, exit_with_failure
from spmd_runtime.launch.supervisor import Child, Supervisor
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.process_entry import CONFIG_ENV

DUMMY = ("--model", "dummy:tiny-llama")


def run_python(args: list[str], env: dict[str, str] | None = None,
               timeout_s: float = 90.0) -> tuple[int, str, float]:
    """`python args` to its end (its process tree killed whatever happens): (exit code,
    stderr, seconds)."""
    tag = uuid.uuid4().hex
    full_env = dict(os.environ, **(env or {}), **{PROC_TAG_ENV: tag})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=full_env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stderr, time.monotonic() - started
    finally:
        kill_tree(proc, tag)


def listening_socket() -> tuple[socket.socket, int]:
    """Another server: a socket listening on a free port of 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def assert_one_clean_failure(stderr: str) -> str:
    """No traceback, no restart; returns the last line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "restart" not in stderr, stderr[-3000:]
    return stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------------------- real jobs

@pytest.mark.timeout(240)
def test_a_second_serve_on_an_rpc_port_in_use_exits_2_with_one_line(spmd_serve) -> None:
    first = spmd_serve(*DUMMY)
    with first.serving():
        code, stderr, seconds = run_python(["-m", "spmd_runtime.launch", "serve", *DUMMY,
                                            "--rpc-address", first.address])
        assert code == 2, stderr[-3000:]
        assert seconds < 60
        last = assert_one_clean_failure(stderr)
        assert first.address in last and "in use" in last, last
        assert first.proc.poll() is None, "the first server must not be disturbed"


@pytest.mark.timeout(240)
def test_a_scheduler_that_cannot_listen_ends_the_job_at_once(tmp_path) -> None:
    """The worker socket's address cannot be bound (its directory does not exist): only the
    scheduler finds out. The job ends with its line, not after the worker's silence timeout."""
    address = f"ipc://{tmp_path}/missing/workers"
    code, stderr, seconds = run_python(["-m", "spmd_runtime.launch", "serve", *DUMMY,
                                        "--rpc-address", f"tcp://127.0.0.1:{free_tcp_port()}",
                                        "--worker-address", address])
    assert code == 2, stderr[-3000:]
    assert seconds < 60
    last = assert_one_clean_failure(stderr)
    assert last.startswith("spmdrun: error: scheduler (pid "), last
    assert f"cannot listen on {address}: No such file or directory" in last, last
    assert "--worker-address" in last and last.count("spmdrun:") == 1, last


@pytest.mark.timeout(240)
def test_a_worker_failing_at_start_is_named_in_the_last_line(weightless_model_dir) -> None:
    """A model directory with a config but no weights: the launcher reads it fine, the worker
    fails to load it and the scheduler exits after it. The worker is named, not the scheduler."""
    broken = weightless_model_dir
    code, stderr, seconds = run_python(["-m", "spmd_runtime.launch", "serve", "--model",
                                        str(broken), "--rpc-address",
                                        f"tcp://127.0.0.1:{free_tcp_port()}"])
    assert code in (1, 2), stderr[-3000:]
    assert seconds < 90
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("spmdrun: error: worker rank 0 (pid "), last
    assert "rank 0 failed" in last and "safetensors" in last, last
    assert "restart" not in stderr, stderr[-3000:]


# ---------------------------------------------------------------------------- processes alone

@pytest.mark.timeout(60)
def test_the_scheduler_alone_on_a_port_in_use_says_so_in_one_line(tmp_path) -> None:
    occupant, port = listening_socket()
    with occupant:
        address = f"tcp://127.0.0.1:{port}"
        config = EngineConfig(model="dummy:tiny-llama", rpc_address=address,
                              worker_address=f"ipc://{tmp_path}/workers")
        code, stderr, seconds = run_python(["-m", "spmd_runtime.scheduler_proc"],
                                           {CONFIG_ENV: config.to_json()}, timeout_s=30)
    assert code == 2, stderr[-3000:]
    assert seconds < 20
    assert stderr.strip().splitlines() == [
        f"spmdrun: error: cannot listen on {address}: Address already in use (another server "
        "there? choose another with --rpc-address)"], stderr[-3000:]


@pytest.mark.timeout(60)
def test_the_http_front_alone_on_a_port_in_use_says_so_in_one_line() -> None:
    occupant, port = listening_socket()
    with occupant:
        config = EngineConfig(rpc_address=f"tcp://127.0.0.1:{free_tcp_port()}", http_port=port)
        code, stderr, _ = run_python(["-m", "spmd_runtime.runtime.serving"],
                                     {CONFIG_ENV: config.to_json()}, timeout_s=45)
    assert code == 2, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"spmdrun: error: cannot listen on http://127.0.0.1:{port}: Address already in use "
        "(another server there? choose another with --http-port)"), stderr[-3000:]
    assert "HTTP front ready" not in stderr and "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.timeout(60)
def test_the_http_front_listens_before_it_says_it_is_ready() -> None:
    """With no engine to wait for, the front is never ready, yet its port is taken at once."""
    port = free_tcp_port()
    config = EngineConfig(rpc_address=f"tcp://127.0.0.1:{free_tcp_port()}", http_port=port)
    tag = uuid.uuid4().hex
    env = dict(os.environ, **{CONFIG_ENV: config.to_json(), PROC_TAG_ENV: tag})
    proc = subprocess.Popen([sys.executable, "-m", "spmd_runtime.runtime.serving"],
                            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the front never listened"
                time.sleep(0.1)
    finally:
        kill_tree(proc, tag)
    assert "HTTP front ready" not in proc.stderr.read()


# ---------------------------------------------------------------------------- the launcher

def fake_child(supervisor: Supervisor, name: str, code: str) -> subprocess.Popen:
    """A child process running `code`, its stderr relayed like an engine process's."""
    process = subprocess.Popen([sys.executable, "-c", f"import sys, time\n{code}"],
                               stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    supervisor.add(name, process)
    return process


def launcher_of(supervisor: Supervisor) -> RunningEngine:
    """A RunningEngine around `supervisor` (no engine started), before it was ready."""
    engine = RunningEngine.__new__(RunningEngine)
    engine.supervisor = supervisor
    engine.config = EngineConfig()
    engine.serves = True
    engine.ready = False
    engine._gave_up = False
    return engine


@pytest.mark.timeout(60)
def test_a_child_exiting_2_before_ready_ends_the_job_with_its_line_and_code_2(capsys) -> None:
    supervisor = Supervisor()
    try:
        scheduler = fake_child(supervisor, "scheduler", "print('spmdrun: error: cannot listen "
                               "on tcp://x:1: Address already in use', file=sys.stderr); "
                               "sys.exit(2)")
        fake_child(supervisor, "worker rank 0", "time.sleep(60)")
        engine = launcher_of(supervisor)
        scheduler.wait(30)
        assert not engine.alive()
        assert exit_with_failure(engine, RuntimeError("engine not ready")) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1] == (f"spmdrun: error: scheduler (pid {scheduler.pid}) exited with code "
                             "2: cannot listen on tcp://x:1: Address already in use; stopped "
                             "the whole job"), lines
        assert "Address already in use" not in "".join(lines[:-1]), "said once, last"
    finally:
        supervisor.stop_all(timeout_s=5, first_grace_s=0)


@pytest.mark.timeout(60)
def test_the_scheduler_is_not_blamed_for_a_worker_that_failed_first(capsys, tmp_path) -> None:
    """The scheduler exits as soon as the worker tells it; the worker exits a moment later,
    having said why. The launcher names the worker, with the worker's code."""
    go = tmp_path / "go"            # the worker says why once the scheduler is gone, not before
    supervisor = Supervisor()
    try:
        scheduler = fake_child(supervisor, "scheduler", (
            "print('2024-01-01 00:00:00,000 ERROR spmd.scheduler: worker rank 0 failed to start',"
            " file=sys.stderr); sys.exit(1)"))
        worker = fake_child(supervisor, "worker rank 0", (
            f"import os\ndeadline = time.monotonic() + 30\n"
            f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
            f"    time.sleep(0.01)\n"
            "print('spmdrun: error: rank 0 failed: no weights', file=sys.stderr); "
            "time.sleep(0.5); sys.exit(2)"))
        engine = launcher_of(supervisor)
        scheduler.wait(30)
        assert worker.poll() is None
        go.touch()
        assert exit_with_failure(engine, RuntimeError("engine not ready")) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == (f"spmdrun: error: worker rank 0 (pid {worker.pid}) exited with code 2: "
                        "rank 0 failed: no weights; stopped the whole job"), last
    finally:
        supervisor.stop_all(timeout_s=5, first_grace_s=0)


def test_a_worker_dying_before_ready_is_not_restarted() -> None:
    engine = launcher_of(Supervisor())
    child = Child("worker rank 0", subprocess.Popen([sys.executable, "-c", "pass"]))
    child.process.wait()
    assert engine._worker_exited(child, 1) is False


@pytest.mark.timeout(120)
def test_sigterm_before_the_engine_is_ready_is_a_clean_stop(spmd_serve, free_port) -> None:
    """Node 1 of this two-node job never comes: the worker waits for it in the process group's
    rendezvous. SIGTERM then stops everything at once, exit code 0."""
    master_port = free_port()
    server = spmd_serve(*DUMMY, launcher=["--nnodes", "2", "--node-rank", "0",
                                          "--master-port", str(master_port)])
    try:
        deadline = time.monotonic() + 60
        while len(procs := server.processes()) < 3:       # launcher, scheduler, worker
            assert server.proc.poll() is None, server.stderr[-3000:]
            assert time.monotonic() < deadline, procs
            time.sleep(0.1)
        started = time.monotonic()
        assert server.terminate(timeout_s=30) == 0, server.stderr[-3000:]
        assert time.monotonic() - started < 8
        assert wait_until_gone(procs, 10) == []
        assert "Traceback" not in server.stderr, server.stderr[-3000:]
    finally:
        server.kill_tree()


@pytest.mark.timeout(240)
def test_workers_outwait_a_slow_first_tokenizer_load(tmp_path) -> None:
    """float32 generation, smollm2. With no tokenizer cache (a fresh XDG_CACHE_HOME), the
    scheduler converts the GGUF's tokenizer for seconds after the worker is ready; the worker,
    told to give up after 1 s of silence, must hear heartbeats all the while, at a third of
    that timeout. (On a busy GPU machine that conversion took 18-23 s and every worker left
    after 5 s. Here the old code failed this in one run of five: whether the worker has heard a
    beat, and so applies the short timeout, before the silence depends on timing.)"""
    code, stderr, _ = run_python(
        ["-m", "spmd_runtime.launch", "generate", "--model", "smollm2", "--dtype", "float32",
         "--heartbeat-timeout-s", "1", "--num-kv-blocks", "64", "--prompt", "Hi",
         "--max-tokens", "2"],
        env={"XDG_CACHE_HOME": str(tmp_path / "cold-cache")}, timeout_s=200)
    assert code == 0, stderr[-3000:]
    assert "tokenizer loaded in" in stderr, stderr[-3000:]
