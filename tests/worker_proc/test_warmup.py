"""A worker warms up the buckets the scheduler hands it (worker.build_runner asking with
WorkerLoaded, warmup.prepare_buckets), whatever its own SPMD_*_BUCKET_* environment says."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from spmd_runtime.protocol.buckets import BucketRange, PhaseBuckets
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import WorkerLoaded
from spmd_runtime.protocol.step_shape import Phase
from spmd_runtime.runtime.layers.attention_backend import choose_attention_backend
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.model_runner import ModelRunner
from spmd_runtime.worker_proc.runner_graphs import GraphRunner, warmup_shapes
from spmd_runtime.worker_proc.warmup import WARMUP_PROMPT_TOKENS, WARMUP_REQUEST_ID
from spmd_runtime.worker_proc.worker import build_runner
from test_kv_cache import TINY_LLAMA

CPU_CONTEXT = DistributedContext(rank=0, local_rank=0, world_size=1,
                                 device=torch.device("cpu"), backend="gloo")
# The scheduler's buckets: one prompt and one decode shape.
SCHEDULER_BUCKETS = {
    "prompt": PhaseBuckets.generate("prompt", BucketRange(1, 1, 1), BucketRange(32, 32, 32), 64),
    "decode": PhaseBuckets.generate("decode", BucketRange(2, 2, 2), BucketRange(32, 32, 32), 64),
}


@pytest.fixture
def tiny_model_name(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return f"dummy:{tmp_path / 'config.json'}"


def test_a_worker_warms_up_the_schedulers_buckets_not_its_environments(
        tiny_model_name, monkeypatch, caplog) -> None:
    # This worker's own environment asks for other decode buckets: it must not matter.
    monkeypatch.setenv("SPMD_DECODE_BS_BUCKET_MIN", "4")
    monkeypatch.setenv("SPMD_DECODE_BS_BUCKET_MAX", "8")
    warmed: list[dict[Phase, PhaseBuckets]] = []
    monkeypatch.setattr(GraphRunner, "warmup", record_warmup(warmed))
    asked: list[WorkerLoaded] = []

    def scheduler(loaded: WorkerLoaded) -> dict[Phase, PhaseBuckets]:
        asked.append(loaded)
        return SCHEDULER_BUCKETS

    config = EngineConfig(model=tiny_model_name, dtype="float32", num_kv_blocks=16,
                          execution_mode="bucketed", max_model_len=64, max_num_batched_tokens=64)
    with caplog.at_level(logging.INFO, logger="spmd.worker"):
        runner, ready = build_runner(config, CPU_CONTEXT, scheduler)
    assert [(m.rank, m.max_model_len, m.device) for m in asked] == [(0, 64, "cpu")]
    # The scheduler learns whether decode buckets need a context dimension.
    assert asked[0].context_from_tensors == runner_attention(config).reads_cache_in_place
    assert warmed == [SCHEDULER_BUCKETS]
    assert f"Generated 1 decode buckets: {[(2, 32)]}" in caplog.text
    assert ready.max_model_len == 64


def test_without_buckets_from_the_scheduler_nothing_is_warmed_up(tiny_model_name,
                                                                 monkeypatch) -> None:
    warmed = []
    monkeypatch.setattr(GraphRunner, "warmup", record_warmup(warmed))
    config = EngineConfig(model=tiny_model_name, dtype="float32", num_kv_blocks=16,
                          execution_mode="bucketed")
    runner, _ = build_runner(config, CPU_CONTEXT, lambda loaded: None)
    assert warmed == [] and not runner.graphs


def record_warmup(warmed: list):
    """A stand-in for ModelRunner.warmup that records the buckets it is given."""
    return lambda self, buckets, free, packed_tokens: warmed.append(buckets)


def runner_attention(config: EngineConfig):
    return choose_attention_backend(config.attention_backend, torch.device("cpu"), torch.float32,
                                    TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"])


def test_a_packed_phase_warms_up_one_step_of_the_token_budget(tiny_model_name, caplog) -> None:
    packed = {"prompt": PhaseBuckets.packed_steps("prompt"),
              "decode": SCHEDULER_BUCKETS["decode"]}
    assert warmup_shapes(packed["prompt"], 48) == [(1, 48)]
    assert warmup_shapes(packed["decode"], 48) == [(2, 32)]
    config = EngineConfig(model=tiny_model_name, dtype="float32", num_kv_blocks=16,
                          execution_mode="bucketed", max_model_len=64, max_num_batched_tokens=48)
    with caplog.at_level(logging.INFO, logger="spmd.worker"):
        build_runner(config, CPU_CONTEXT, lambda loaded: packed)
    assert "Prompt steps packed" in caplog.text
    assert "[Warmup][Prompt][1/1] batch_size:1 seq_len:48" in caplog.text
    assert "[Warmup][Decode][1/1] batch_size:2 seq_len:32" in caplog.text


def recorded_plans(monkeypatch) -> list:
    """ModelRunner.execute wrapped to record every plan it runs."""
    plans = []
    execute = ModelRunner.execute

    def recording(self, plan):
        plans.append(plan)
        return execute(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return plans


def test_an_unpadded_cpu_worker_warms_up_with_one_prompt_then_forgets_it(
        tiny_model_name, monkeypatch, caplog) -> None:
    """float32, a tiny model: without buckets, build_runner runs one greedy prompt (as long as
    the pool and max_model_len allow, under WARMUP_PROMPT_TOKENS) in the pool's first blocks,
    then drops it: the runner serves holding no request."""
    plans = recorded_plans(monkeypatch)
    config = EngineConfig(model=tiny_model_name, dtype="float32", num_kv_blocks=8,
                          max_model_len=200)
    with caplog.at_level(logging.INFO, logger="spmd.worker"):
        runner, _ = build_runner(config, CPU_CONTEXT)
    assert len(plans) == 2
    (request,) = plans[0].new_requests
    tokens = min(WARMUP_PROMPT_TOKENS, 199, 8 * config.block_size - 1)
    assert request.request_id == WARMUP_REQUEST_ID and len(request.token_ids) == tokens == 127
    assert request.num_scheduled_tokens == tokens and request.block_ids == list(range(8))
    assert plans[1].dropped_request_ids == [WARMUP_REQUEST_ID] and not plans[1].new_requests
    assert not runner.requests
    assert "rank 0 warm-up: a 127-token prompt" in caplog.text


def test_skip_warmup_skips_the_unpadded_warm_up(tiny_model_name, monkeypatch) -> None:
    plans = recorded_plans(monkeypatch)
    config = EngineConfig(model=tiny_model_name, dtype="float32", num_kv_blocks=8,
                          skip_warmup=True)
    build_runner(config, CPU_CONTEXT)
    assert plans == []
