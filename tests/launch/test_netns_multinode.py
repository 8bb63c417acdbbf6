"""Tensor parallelism across three hosts: three network namespaces on one bridge, each with its
own address and its own `spmdrun` launcher, as a user runs a multi-node job. The host name
resolves to 127.0.0.1 there (as on many machines), so the workers' collectives must pick the
interface that reaches the master themselves (or use the one GLOO_SOCKET_IFNAME names)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from netns_tools.netns import NamespaceHosts, namespaces_unavailable
from spmd_runtime.protocol.curve import make_job_keys

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None,
                                reason=f"no test hosts: {namespaces_unavailable()}")

PROMPTS = ["What is the capital of France?", "Name three colours.", "Count from one to five."]
GENERATE = ["generate", "--model", "smollm2", "--dtype", "float32", "--max-tokens", "12", "--output", "jsonl",
            "--max-model-len", "256", "--kv-cache-memory", "256MiB",
            *[arg for prompt in PROMPTS for arg in ("--prompt", prompt)]]
LAUNCHER = [sys.executable, "-m", "spmd_runtime.launch"]


def answers(stdout: str) -> list[list[int]]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [row["token_ids"] for row in sorted(rows, key=lambda row: row["index"])]


@pytest.fixture(scope="module")
def one_worker() -> list[list[int]]:
    result = subprocess.run([*LAUNCHER, *GENERATE], capture_output=True, text=True, timeout=600,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    return answers(result.stdout)


@pytest.mark.timeout(900)
def test_tp3_across_three_hosts_equals_one_worker(one_worker, tmp_path) -> None:
    """With the auth token and CURVE on (node 2 holds only the public key). Node 1 names its
    interface (GLOO_SOCKET_IFNAME); nodes 0 and 2 find it themselves."""
    make_job_keys(tmp_path / "keys")
    key_of = [str(tmp_path / "keys"), str(tmp_path / "keys"), str(tmp_path / "keys" / "job.key")]
    with NamespaceHosts(3) as hosts:
        job = ["--nnodes", "3", "--nproc-per-node", "1", "--master-addr", hosts.addresses[0],
               "--master-port", "29500"]
        secret = {"SPMD_API_KEY": "cross-host-secret"}
        logs, procs = [], []
        for node in range(3):
            env = dict(os.environ, **secret)
            if node == 1:
                env["GLOO_SOCKET_IFNAME"] = hosts.interface
            logs.append(open(tmp_path / f"node{node}.log", "w+"))
            procs.append(hosts.popen(node, [*LAUNCHER, *job, "--node-rank", str(node),
                                            *GENERATE, "--allow-remote",
                                            "--curve-keys", key_of[node]],
                                     env=env, stdout=subprocess.PIPE if node == 0 else logs[node],
                                     stderr=logs[node], stdin=subprocess.DEVNULL, text=True))
        try:
            stdout, _ = procs[0].communicate(timeout=600)
            codes = [procs[0].returncode] + [proc.wait(60) for proc in procs[1:]]
        finally:
            text = []
            for log in logs:
                log.seek(0)
                text.append(log.read())
                log.close()
        assert codes == [0, 0, 0], "\n\n".join(t[-3000:] for t in text)
        assert answers(stdout) == one_worker
        assert "collectives use interface eth0" in text[2], text[2][-3000:]
        assert "named by GLOO_SOCKET_IFNAME=eth0" in text[1], text[1][-3000:]
