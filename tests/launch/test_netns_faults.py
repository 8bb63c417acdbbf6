"""Faults across three hosts (network namespaces), with 20 streams in flight each time: node
2's launcher and workers killed and a replacement launcher started, node 1's link cut for 10 s,
a worker frozen by SIGSTOP. Node 0 restarts the group on every node; every stream completes
with the tokens of an undisturbed run. With no restarts left, every request fails naming the
node and every process on every host exits."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from datetime import datetime

import psutil
import pytest
from conftest import wait_until
from netns_tools.netns import NamespaceHosts, namespaces_unavailable
from sharp_llama import sharp_llama

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None,
                                reason=f"no test hosts: {namespaces_unavailable()}")

NUM_STREAMS = 20
MAX_TOKENS = 100
TOKEN = "fault-test-token"
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "512", "--max-num-seqs", "32",
          "--heartbeat-timeout-s", "5"]
CLIENT = """
import asyncio, json, sys
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.async_client import AsyncClient

async def main(address, token, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, errors, told = [[] for _ in prompts], [None] * len(prompts), []
    async with AsyncClient(address, auth_token=token, timeout_s=600) as client:
        await client.wait_ready(600)
        streams = [await client.submit(p, params, detokenize=False) for p in prompts]
        async def collect(i, stream):
            try:
                async for delta in stream:
                    tokens[i] += delta.token_ids
                    if not told and all(len(t) >= 3 for t in tokens):
                        told.append(1)
                        print("streaming", flush=True)
            except Exception as error:
                errors[i] = str(error)
        await asyncio.gather(*(collect(i, s) for i, s in enumerate(streams)))
    print(json.dumps({"tokens": tokens, "errors": errors}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])))
"""


def stream_prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 240 + 5 for j in range(4 + i % 9)] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return sharp_llama(tmp_path_factory.mktemp("tp3-llama"), 6, 3, hidden=96,
                       intermediate=192)[0]


@pytest.fixture(scope="module")
def undisturbed(model) -> list[list[int]]:
    from spmd_runtime.runtime import LLM, SamplingParams
    with LLM(model, nproc_per_node=3, dtype="float32", max_model_len=256, num_kv_blocks=512) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(stream_prompts(), params)]


class Job:
    """A 3-host TP=3 job serving on node 0's loopback; logs per node."""

    def __init__(self, hosts: NamespaceHosts, model: str, log_dir, *extra: str) -> None:
        self.hosts, self.log_dir = hosts, log_dir
        self.argv = [sys.executable, "-m", "spmd_runtime.launch", "--nnodes", "3",
                     "--nproc-per-node", "1", "--master-addr", hosts.addresses[0],
                     "--master-port", "29500", "serve", "--model", model, "--allow-remote",
                     "--rpc-address", "tcp://127.0.0.1:7000", *ENGINE, *extra]
        self.env = dict(os.environ, SPMD_API_KEY=TOKEN)
        self.launchers = [self.start(node) for node in range(3)]

    def start(self, node: int, suffix: str = "") -> subprocess.Popen:
        log = open(self.log_dir / f"node{node}{suffix}.log", "w")
        split = self.argv.index("serve")
        argv = [*self.argv[:split], "--node-rank", str(node), *self.argv[split:]]
        return self.hosts.popen(node, argv, env=self.env, stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)

    def log(self, node: int, suffix: str = "") -> str:
        return (self.log_dir / f"node{node}{suffix}.log").read_text()

    def client(self) -> subprocess.Popen:
        return self.hosts.popen(0, [sys.executable, "-c", CLIENT, "tcp://127.0.0.1:7000", TOKEN,
                                    json.dumps(stream_prompts()), str(MAX_TOKENS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)

    def worker_pid(self, node: int) -> int:
        for pid in self.hosts.pids(node):
            try:
                if "spmd_runtime.worker_proc" in " ".join(psutil.Process(pid).cmdline()):
                    return pid
            except psutil.Error:
                continue
        raise AssertionError(f"no worker on node {node}")

    def diagnostics(self) -> str:
        return "\n\n".join(f"--- node {n}\n{self.log(n)[-2500:]}" for n in range(3))


def wait_streaming(job: Job, client: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Until the client says every stream has tokens; fails at once if the job or the client
    ends first."""
    deadline = time.monotonic() + timeout_s
    while not select.select([client.stdout], [], [], 1.0)[0]:
        if client.poll() is not None or job.launchers[0].poll() is not None:
            raise AssertionError(client.stderr.read()[-2000:] + job.diagnostics())
        assert time.monotonic() < deadline, job.diagnostics()
    assert client.stdout.readline().strip() == "streaming", job.diagnostics()


def run_round(job: Job, fault) -> dict:
    """Start 20 streams, inject the fault once all stream, wait for the results."""
    client = job.client()
    wait_streaming(job, client)
    fault()
    out, err = client.communicate(timeout=400)
    assert client.returncode == 0, err[-3000:] + job.diagnostics()
    return json.loads(out.strip().splitlines()[-1])


def log_time(line: str) -> float:
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line).group(1)
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.timeout(900)
def test_kill_link_cut_and_freeze_lose_nothing(model, undisturbed, tmp_path) -> None:
    with NamespaceHosts(3) as hosts:
        job = Job(hosts, model, tmp_path, "--max-restarts", "3")

        def kill_node_2() -> None:
            for pid in hosts.pids(2):
                os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not hosts.pids(2), 30, what="node 2 emptied")
            job.start(2, "-replaced")            # the replacement rejoins

        def cut_node_1() -> None:
            hosts.set_link(1, up=False)
            time.sleep(10)                       # the outage itself, not a wait on anything
            hosts.set_link(1, up=True)

        frozen = {}

        def freeze_node_2_worker() -> None:
            frozen["pid"] = job.worker_pid(2)
            frozen["at"] = time.time()
            os.kill(frozen["pid"], signal.SIGSTOP)

        try:
            for fault in (kill_node_2, cut_node_1, freeze_node_2_worker):
                result = run_round(job, fault)
                assert result["errors"] == [None] * NUM_STREAMS, result["errors"]
                assert result["tokens"] == undisturbed, fault.__name__
            silent = [line for line in job.log(0).splitlines()
                      if "worker rank 2 on node 2 went silent" in line]
            assert silent, job.diagnostics()
            assert log_time(silent[-1]) - frozen["at"] <= 6.0, silent[-1]
            assert "generation 3" in job.log(0), job.diagnostics()
        finally:
            if "pid" in frozen:
                try:
                    os.kill(frozen["pid"], signal.SIGCONT)
                except ProcessLookupError:
                    pass


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["no_restarts_left", "node_never_back"])
def test_without_restarts_every_request_fails_naming_the_node(model, tmp_path, case) -> None:
    """A worker killed with --max-restarts 0; or node 2 killed whole, restarted around, and
    never back within --rejoin-timeout-s."""
    options = (["--max-restarts", "0"] if case == "no_restarts_left"
               else ["--max-restarts", "2", "--rejoin-timeout-s", "8"])
    with NamespaceHosts(3) as hosts:
        job = Job(hosts, model, tmp_path, *options)
        client = job.client()
        wait_streaming(job, client)
        victims = [job.worker_pid(2)] if case == "no_restarts_left" else hosts.pids(2)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, err = client.communicate(timeout=300)
        result = json.loads(out.strip().splitlines()[-1])
        assert all(error and "node 2" in error for error in result["errors"]), result["errors"]
        for node, launcher in enumerate(job.launchers):
            if case == "no_restarts_left" or node != 2:       # node 2's was killed
                assert launcher.wait(120) != 0, job.log(node)[-3000:]
        wait_until(lambda: not any(hosts.pids(n) for n in range(3)), 60,
                   what="every process on every host gone")
