"""Thermal across nodes: a hot device on node 2 (a file sensor) caps the batch node 0's
scheduler runs within 2 steps, as on one node; the outputs are those of an undisturbed run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from netns_tools.netns import NamespaceHosts, namespaces_unavailable
from sharp_llama import sharp_llama

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None,
                                reason=f"no test hosts: {namespaces_unavailable()}")

TOKEN = "thermal-test-token"
CLIENT = """
import json, os, sys, threading, time
from spmd_runtime.runtime import Client, SamplingParams

address, token, temp_dir = sys.argv[1:4]
params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 2 * i)] for i in range(6)]
outputs = {}

def write(rank, value):
    staging = os.path.join(temp_dir, f"temp{rank}.tmp")
    with open(staging, "w") as f:
        f.write(f"{value}\\n")
    os.replace(staging, os.path.join(temp_dir, f"temp{rank}"))

def wait(client, condition, what, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if condition(stats):
            return stats
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}: {stats}")
        time.sleep(0.02)

def work():
    with Client(address, auth_token=token, timeout_s=300) as client:
        outputs["hot"] = [o.token_ids for o in client.generate(prompts, params)]

with Client(address, auth_token=token, timeout_s=300) as client:
    client.wait_ready(300)
    background = threading.Thread(target=work)
    background.start()
    wait(client, lambda s: s.num_running == 6, "six running")
    write(2, 80.0)                                   # near the target: planned step by step
    wait(client, lambda s: s.max_temp_c == 80.0, "the warm reading")
    write(2, 83.0)
    written_at = client.stats().num_steps
    hot = wait(client, lambda s: s.thermal_evictions > 0, "a thermal eviction")
    write(2, 60.0)
    background.join(300)
    client.reset_prefix_cache()
    cool = [o.token_ids for o in client.generate(prompts, params)]
    evict = [e for e in hot.thermal_events if e.kind == "thermal_evict"][0]
    print(json.dumps({"written_at": written_at, "evict_step": evict.step,
                      "hottest_rank": hot.hottest_rank, "temps": hot.rank_temps_c,
                      "cap": evict.cap, "same": outputs["hot"] == cool,
                      "lengths": [len(t) for t in outputs["hot"]]}), flush=True)
"""


@pytest.mark.timeout(600)
def test_a_hot_device_on_node_2_caps_node_0s_batch_within_two_steps(tmp_path) -> None:
    model = sharp_llama(tmp_path / "model", 6, 3, hidden=96, intermediate=192)[0]
    for rank in range(3):
        (tmp_path / f"temp{rank}").write_text("60.0\n")
    with NamespaceHosts(3) as hosts:
        argv = [sys.executable, "-m", "spmd_runtime.launch", "--nnodes", "3",
                "--nproc-per-node", "1", "--master-addr", hosts.addresses[0], "--master-port",
                "29500"]
        engine = ["serve", "--model", model, "--dtype", "float32", "--allow-remote", "--rpc-address",
                  "tcp://127.0.0.1:7000", "--max-model-len", "256", "--num-kv-blocks", "256",
                  "--max-num-seqs", "8", "--kv-swap-memory", "0.01GiB",
                  "--thermal-sensor", f"file:{tmp_path}/temp{{rank}}",
                  "--thermal-target-c", "82", "--thermal-hysteresis-c", "3"]
        env = dict(os.environ, SPMD_API_KEY=TOKEN)
        logs = [open(tmp_path / f"node{node}.log", "w") for node in range(3)]
        for node in range(3):
            hosts.popen(node, [*argv, "--node-rank", str(node), *engine], env=env,
                        stdout=logs[node], stderr=logs[node], stdin=subprocess.DEVNULL)
        client = hosts.run(0, [sys.executable, "-c", CLIENT, "tcp://127.0.0.1:7000", TOKEN,
                               str(tmp_path)], capture_output=True, text=True, timeout=500,
                           stdin=subprocess.DEVNULL)
    node_logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-2000:] for n in range(3))
    assert client.returncode == 0, client.stdout[-2000:] + client.stderr[-3000:] + node_logs
    result = json.loads(client.stdout.strip().splitlines()[-1])
    assert result["hottest_rank"] == 2 and result["temps"] == [60.0, 60.0, 83.0], result
    assert result["evict_step"] <= result["written_at"] + 2, result
    assert result["cap"] == 5, result
    assert result["lengths"] == [120] * 6 and result["same"], result
