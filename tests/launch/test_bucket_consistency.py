"""Two nodes started with different SPMD_*_BUCKET_* environments still run one set of buckets:
node 0's scheduler derives them and sends them to every worker (WarmupPlan), so both nodes warm
up node 0's buckets, and the job's greedy outputs equal a single worker's."""
from __future__ import annotations

import pytest
from conftest import wait_until
from sharp_llama import GREEDY, SMALL, prompts, sharp_llama
from spmd_runtime.protocol.buckets import engine_buckets
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.config_resolve import environment_options
from spmd_runtime.runtime import LLM
from test_multinode import free_port_pair, generate

ENGINE = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--max-num-batched-tokens", "64",
          "--max-model-len", "128",
          "--execution-mode", "bucketed"]
# The same variables, set differently on each node: decode batch sizes and prompt lengths.
NODE_ENVS = (
    {"SPMD_DECODE_BS_BUCKET_MIN": "1", "SPMD_DECODE_BS_BUCKET_STEP": "2",
     "SPMD_DECODE_BS_BUCKET_MAX": "4", "SPMD_PROMPT_SEQ_BUCKET_MIN": "32",
     "SPMD_PROMPT_SEQ_BUCKET_STEP": "32", "SPMD_PROMPT_SEQ_BUCKET_MAX": "64"},
    {"SPMD_DECODE_BS_BUCKET_MIN": "2", "SPMD_DECODE_BS_BUCKET_STEP": "8",
     "SPMD_DECODE_BS_BUCKET_MAX": "8", "SPMD_PROMPT_SEQ_BUCKET_MIN": "16",
     "SPMD_PROMPT_SEQ_BUCKET_STEP": "16", "SPMD_PROMPT_SEQ_BUCKET_MAX": "48"},
)


def bucket_lines(env: dict[str, str], monkeypatch) -> list[str]:
    """The 'Generated N <phase> buckets: [...]' lines an engine with this environment logs."""
    # The launcher folds its environment into the bucket options (protocol/config_resolve.py).
    config = EngineConfig(model="unused", execution_mode="bucketed", **SMALL,
                          **environment_options(SMALL, env))
    return [b.list_line() for b in engine_buckets(config, SMALL["max_model_len"]).values()]


@pytest.mark.timeout(300)
def test_two_nodes_with_different_bucket_environments_run_node_0s_buckets(
        spmd_serve, tmp_path, monkeypatch) -> None:
    model = sharp_llama(tmp_path / "sharp-llama")[0]
    expected, node1_own = (bucket_lines(env, monkeypatch) for env in NODE_ENVS)
    assert set(expected).isdisjoint(node1_own), "the two environments must disagree"
    master = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port_pair())]
    nodes = []
    try:
        for node_rank, env in enumerate(NODE_ENVS):
            with monkeypatch.context() as patch:        # ServeProcess copies os.environ
                for name, value in env.items():
                    patch.setenv(name, value)
                nodes.append(spmd_serve("--model", model, *ENGINE,
                                        launcher=[*master, "--node-rank", str(node_rank)]))
        nodes[0].wait_serving()
        # The scheduler serves once every worker has warmed up; each node logs what it ran.
        for node in nodes:
            wait_until(lambda node=node: all(line in node.stderr for line in expected), 30.0,
                       what=lambda node=node: f"node 0's buckets in:\n{node.stderr[-3000:]}")
            assert not any(line in node.stderr for line in node1_own), node.stderr[-3000:]
        outputs = generate(nodes[0].address)
    finally:
        for node in nodes:
            node.kill_tree()
    with LLM(model, dtype="float32", **SMALL) as llm:
        assert outputs == [o.token_ids for o in llm.generate(prompts(), GREEDY)]
