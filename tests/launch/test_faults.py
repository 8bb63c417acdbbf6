"""Faults: the scheduler killed under `spmdrun serve` (launcher and workers exit, clients get
an error), and workers whose scheduler dies while no launcher watches them (torchrun) exit on
their own when the heartbeats stop."""
from __future__ import annotations

import signal
import subprocess
import threading
import time

import psutil
import pytest
from conftest import TorchrunEngine, free_tcp_port
from sharp_llama import sharp_llama
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime import Client, SamplingParams
from spmd_runtime.runtime.client import EngineError

LONG = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
# CPU workers: two ranks on one host, and outputs compared exactly across a restart.
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return sharp_llama(tmp_path_factory.mktemp("faults-llama"), 4, 2)[0]


def stream_in_background(address: str):
    """A client streaming a long request; returns (thread, outcome dict, an event set once the
    first tokens arrived)."""
    outcome: dict = {}
    streaming = threading.Event()

    def work():
        with Client(address, timeout_s=4.0) as client:
            try:
                for delta in client.stream([5, 6, 7], SamplingParams(
                        max_tokens=200, temperature=0.0, ignore_eos=True)):
                    outcome["tokens"] = outcome.get("tokens", 0) + len(delta.token_ids)
                    streaming.set()
                    time.sleep(0.05)       # a slow reader: the request outlives the kill
            except EngineError as error:
                outcome["error"] = str(error)
            finally:
                streaming.set()            # never leave the test waiting on a dead stream
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, outcome, streaming


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


@pytest.mark.timeout(300)
def test_killing_the_scheduler_stops_the_job_and_fails_the_client(spmd_serve, tiny_model) -> None:
    server = spmd_serve("--model", tiny_model, "--device", "cpu",
                        "--num-kv-blocks", "64", "--max-model-len", "256",
                        launcher=["--nproc-per-node", "2"])
    try:
        server.wait_serving()
        thread, outcome, streaming = stream_in_background(server.address)
        streaming.wait(60)
        assert outcome.get("tokens"), outcome
        children = [p for p in server.processes() if p.pid != server.proc.pid]
        assert len(children) == 3          # scheduler, two workers
        server.child("scheduler_proc").kill()
        killed_at = time.monotonic()
        assert server.proc.wait(10) == 1, server.stderr[-3000:]
        alive = wait_gone(children, max(0.0, killed_at + 10 - time.monotonic()))
        assert not alive, f"still running 10 s after the scheduler died: {alive}"
        assert "scheduler" in server.stderr and "stopped the whole job" in server.stderr
        thread.join(15)
        assert not thread.is_alive(), "the client is still waiting"
        assert "error" in outcome, outcome
        assert time.monotonic() - killed_at < 15
    finally:
        server.kill_tree()


@pytest.mark.timeout(300)
def test_workers_without_a_launcher_exit_when_heartbeats_stop(tmp_path, tiny_model) -> None:
    port = free_tcp_port()
    rpc = f"tcp://127.0.0.1:{free_tcp_port()}"
    config = EngineConfig(model=tiny_model, nproc_per_node=2, master_port=port,
                          worker_address=f"tcp://127.0.0.1:{free_tcp_port()}", rpc_address=rpc,
                          heartbeat_timeout_s=3.0, **ENGINE)
    with TorchrunEngine(config, tmp_path / "engine.log") as engine:
        with Client(rpc, timeout_s=120) as client:
            client.wait_ready(240)
            (out,) = client.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
            assert len(out.token_ids) == 4
            # Idle for longer than the heartbeat timeout: heartbeats keep the workers up. Waiting
            # on the workers' exit (not sleeping) fails the test the moment they leave.
            idle_s = config.heartbeat_timeout_s * 1.5
            with pytest.raises(subprocess.TimeoutExpired):
                engine.workers.wait(idle_s)
                pytest.fail(f"the workers exited while idle:\n{engine.log[-3000:]}")
            # ...and still serve after the silence.
            (out,) = client.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
            assert len(out.token_ids) == 4
        engine.scheduler.send_signal(signal.SIGKILL)
        engine.scheduler.wait(10)
        # 3 s of silence, then the workers exit and torchrun with them: waited for with a
        # generous deadline; the log says the silence was the reason.
        try:
            engine.workers.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"workers still up 60 s after the scheduler died:\n{engine.log[-3000:]}")
        assert "no plan or heartbeat from the scheduler for 3s" in engine.log, engine.log[-3000:]


PROMPTS = [[(11 * i + 5 * j) % 240 + 1 for j in range(4 + i % 7)] for i in range(20)]
STREAMED = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


class Streams:
    """20 requests streaming at once, each on its own client and thread."""

    def __init__(self, address: str) -> None:
        self.tokens: list[list[int]] = [[] for _ in PROMPTS]
        self.finish: list[str | None] = [None] * len(PROMPTS)
        self.errors: list[tuple[float, str] | None] = [None] * len(PROMPTS)
        self._lock = threading.Lock()
        self._num_started = 0
        self.all_started = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(address, i), daemon=True)
                        for i in range(len(PROMPTS))]
        for thread in self.threads:
            thread.start()

    def _stream(self, address: str, index: int) -> None:
        with Client(address, timeout_s=60) as client:
            try:
                for delta in client.stream(PROMPTS[index], STREAMED):
                    first = not self.tokens[index] and delta.token_ids
                    self.tokens[index] += delta.token_ids
                    self.finish[index] = delta.finish_reason
                    if first:
                        with self._lock:
                            self._num_started += 1
                            if self._num_started == len(PROMPTS):
                                self.all_started.set()
            except EngineError as error:
                self.errors[index] = (time.monotonic(), str(error))

    def wait_all_started(self, timeout_s: float = 120.0) -> None:
        self.all_started.wait(timeout_s)
        assert all(self.tokens), "not every stream started"

    def join(self, timeout_s: float) -> None:
        for thread in self.threads:
            thread.join(timeout_s)
        assert not any(thread.is_alive() for thread in self.threads), "a stream hangs"


def worker_of(server, rank: int) -> psutil.Process:
    for proc in server.processes():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if "worker_proc" in " ".join(proc.cmdline()) and env.get("RANK") == str(rank):
            return proc
    raise AssertionError(f"no worker of rank {rank}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("tp", "victim"), [(1, 0), (2, 1)], ids=["tp1", "tp2"])
def test_a_killed_worker_is_replaced_and_every_stream_completes(spmd_serve, tiny_model, tp,
                                                                victim) -> None:
    server = spmd_serve("--model", tiny_model, "--device", "cpu",
                        "--num-kv-blocks", "128", "--max-model-len", "256",
                        launcher=["--nproc-per-node", str(tp)])
    try:
        server.wait_serving()
        streams = Streams(server.address)
        streams.wait_all_started()
        worker_of(server, victim).kill()
        streams.join(240)
        assert streams.errors == [None] * len(PROMPTS), streams.errors
        assert streams.finish == ["length"] * len(PROMPTS)
        # Nothing lost, nothing streamed twice: exactly max_tokens, equal to an undisturbed run.
        assert [len(t) for t in streams.tokens] == [STREAMED.max_tokens] * len(PROMPTS)
        with Client(server.address, timeout_s=60) as client:
            stats = client.stats()
            assert stats.num_worker_restarts == 1 and stats.num_finished == len(PROMPTS)
            client.reset_prefix_cache()
            undisturbed = [o.token_ids for o in client.generate(PROMPTS, STREAMED)]
        assert streams.tokens == undisturbed
        assert "restarting the worker group (restart 1 of 3 this hour)" in server.stderr
    finally:
        server.kill_tree()


@pytest.mark.timeout(300)
def test_without_restarts_every_stream_ends_with_a_clear_error(spmd_serve, tiny_model) -> None:
    server = spmd_serve("--model", tiny_model, "--device", "cpu",
                        "--num-kv-blocks", "128", "--max-model-len", "256",
                        "--max-restarts", "0", launcher=["--nproc-per-node", "2"])
    try:
        server.wait_serving()
        streams = Streams(server.address)
        streams.wait_all_started()
        procs = [p for p in server.processes() if p.pid != server.proc.pid]
        worker_of(server, 1).kill()
        killed_at = time.monotonic()
        streams.join(60)
        assert all(error is not None for error in streams.errors), streams.errors
        for at, message in streams.errors:
            assert "the engine is down" in message and "worker rank 1" in message, message
            assert at - killed_at < 5.0
        assert server.proc.wait(30) == 1
        assert not wait_gone(procs, 10.0)
    finally:
        server.kill_tree()
