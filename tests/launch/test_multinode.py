"""Tensor parallelism across "nodes" on one machine: two spmdrun launchers with --nnodes 2 on
loopback (one worker each), and workers started by torchrun beside a scheduler started by hand,
both give the same greedy outputs as TP=2 on one node."""
from __future__ import annotations

import socket

import pytest
from conftest import TorchrunEngine, free_tcp_port
from sharp_llama import GREEDY, prompts, sharp_llama
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime import LLM, Client

# CPU workers: the "nodes" here share one host (and at most one GPU).
ENGINE = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--max-num-batched-tokens", "64",
          "--max-model-len", "128"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return sharp_llama(tmp_path_factory.mktemp("tp-llama"), 4, 2)[0]


@pytest.fixture(scope="module")
def one_node_tp2(tiny_model) -> list[list[int]]:
    with LLM(tiny_model, nproc_per_node=2, num_kv_blocks=64, max_num_batched_tokens=64,
             max_model_len=128, dtype="float32", device="cpu") as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


def free_port_pair() -> int:
    """A free port P with P + 1 free too: the scheduler's worker socket binds P + 1."""
    for _ in range(100):
        port = free_tcp_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def generate(address: str) -> list[list[int]]:
    client = Client(address, timeout_s=240.0)
    try:
        return [o.token_ids for o in client.generate(prompts(), GREEDY)]
    finally:
        client.close()


@pytest.mark.timeout(600)
def test_two_launchers_with_one_worker_each_equal_tp2_on_one_node(
        spmd_serve, tiny_model, one_node_tp2) -> None:
    master = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port_pair())]
    node0 = spmd_serve("--model", tiny_model, *ENGINE, launcher=[*master, "--node-rank", "0"])
    node1 = spmd_serve("--model", tiny_model, *ENGINE, launcher=[*master, "--node-rank", "1"])
    try:
        node0.wait_serving()
        assert generate(node0.address) == one_node_tp2
    finally:
        node0.kill_tree()
        node1.kill_tree()


@pytest.mark.timeout(600)
def test_workers_started_by_torchrun_equal_tp2_on_one_node(tmp_path, tiny_model,
                                                           one_node_tp2) -> None:
    port = free_tcp_port()
    rpc = f"tcp://127.0.0.1:{free_tcp_port()}"
    config = EngineConfig(model=tiny_model, dtype="float32", device="cpu", num_kv_blocks=64,
                          max_num_batched_tokens=64,
                          max_model_len=128, nproc_per_node=2, master_port=port,
                          worker_address=f"tcp://127.0.0.1:{free_tcp_port()}", rpc_address=rpc)
    with TorchrunEngine(config, tmp_path / "engine.log") as engine:
        assert generate(rpc) == one_node_tp2, engine.log[-3000:]
