"""The scheduler built from what the workers report (scheduler_proc/startup.py): its step token
budget, --max-num-batched-tokens with 0 (auto) made concrete for the workers' device type, and
the buckets derived from that same budget."""
from __future__ import annotations

import pytest
from spmd_runtime.protocol.buckets import engine_buckets
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import WorkerReady
from spmd_runtime.scheduler_proc.startup import build_scheduler
from spmd_runtime.scheduler_proc.thermal import ProportionalThermalPolicy, ThermalControl


def ready(device: str) -> dict[int, WorkerReady]:
    return {0: WorkerReady(rank=0, num_kv_blocks=64, max_model_len=2048, vocab_size=128,
                           eos_token_ids=[2], device=device)}


def scheduler_budget(config: EngineConfig, device: str) -> int:
    thermal = ThermalControl(ProportionalThermalPolicy(target_c=82.0, hysteresis_c=3.0))
    scheduler, _ = build_scheduler(config, ready(device), None, thermal)
    return scheduler.max_num_batched_tokens


@pytest.mark.parametrize(("device", "budget"), [("cpu", 4096), ("cuda:0", 1024)])
def test_auto_budget_follows_the_workers_device(device: str, budget: int) -> None:
    assert EngineConfig().max_num_batched_tokens == 0      # auto is the default
    assert scheduler_budget(EngineConfig(), device) == budget


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_given_budget_is_kept_on_every_device(device: str) -> None:
    assert scheduler_budget(EngineConfig(max_num_batched_tokens=768), device) == 768


def test_cuda_buckets_under_auto_are_those_of_1024_tokens() -> None:
    """On CUDA the prompt buckets are sized from the budget: auto leaves them as they were."""
    auto = EngineConfig(execution_mode="bucketed")
    given = EngineConfig(execution_mode="bucketed", max_num_batched_tokens=1024)
    assert engine_buckets(auto, 2048, "cuda") == engine_buckets(given, 2048, "cuda")
    assert engine_buckets(auto, 2048, "cpu") == engine_buckets(
        EngineConfig(execution_mode="bucketed", max_num_batched_tokens=4096), 2048, "cpu")
