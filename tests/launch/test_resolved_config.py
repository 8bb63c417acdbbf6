"""The configuration is resolved once, where it is made (the command line, LLM): option given,
else its SPMD_* variable, else the default (protocol/config_resolve.py). The processes of an
engine read their options from the config they are handed and never from their environment:
started with a poisoned one, they run the config."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from conftest import PROC_TAG_ENV, REPO_ROOT, free_tcp_port, kill_tree, wait_until
from spmd_runtime.launch.cli import build_parser
from spmd_runtime.launch.options import config_from_args
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.process_entry import CONFIG_ENV
from spmd_runtime.runtime import Client, SamplingParams

# Every option variable, set to what a process reading it would act on or die of.
POISON = {"SPMD_DECODE_BS_BUCKET_MAX": "2", "SPMD_DECODE_SEQ_BUCKET_MIN": "junk",
          "SPMD_PROMPT_SEQ_BUCKET_MAX": "256", "SPMD_PROMPT_SEQ_BUCKET_STEP": "junk",
          "SPMD_ROW_PARALLEL_CHUNKS": "junk", "SPMD_ROW_PARALLEL_CHUNK_THRESHOLD": "junk"}


def test_the_command_line_takes_variables_for_options_not_given(monkeypatch) -> None:
    monkeypatch.setenv("SPMD_DECODE_BS_BUCKET_MAX", "16")
    monkeypatch.setenv("SPMD_ROW_PARALLEL_CHUNKS", "4")
    config = config_from_args(build_parser().parse_args(["serve"]))
    assert (config.decode_bs_bucket, config.row_parallel_chunks) == (",,16", 4)
    given = config_from_args(build_parser().parse_args(
        ["serve", "--decode-bs-bucket", "1,2,8", "--row-parallel-chunks", "2"]))
    assert (given.decode_bs_bucket, given.row_parallel_chunks) == ("1,2,8", 2)


@pytest.mark.timeout(240)
def test_an_engine_in_a_poisoned_environment_runs_the_config_it_was_handed(tmp_path) -> None:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    config = EngineConfig(model="dummy:tiny-llama", dtype="float32", execution_mode="bucketed",
                          max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                          num_kv_blocks=64, rpc_address=address,
                          worker_address=f"ipc://{tmp_path}/workers")
    tag = uuid.uuid4().hex
    env = dict(os.environ, **POISON, **{CONFIG_ENV: config.to_json(), PROC_TAG_ENV: tag})
    stdout, stderr = tmp_path / "serve.out", tmp_path / "serve.err"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "spmd_runtime.launch", "serve"],
                                cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err)
    try:
        wait_until(lambda: "serving" in stdout.read_text() or proc.poll() is not None, 200,
                   what=lambda: stderr.read_text()[-3000:])
        log = stderr.read_text()
        assert proc.poll() is None, log[-3000:]
        # The defaults of this config: decode batch sizes 1, 2, 4 (the poison says up to 2),
        # prompt chunks up to 128 tokens (the poison says 256).
        assert "Generated 3 decode buckets: [(1, 128), (2, 128), (4, 128)]" in log, log[-3000:]
        assert "bs:[1, 32, 1], seq:[64, 128, 128]" in log, log[-3000:]
        with Client(address) as client:
            outputs = client.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(outputs[0].token_ids) == 3
    finally:
        kill_tree(proc, tag)
