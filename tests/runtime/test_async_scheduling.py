"""Scheduling ahead end to end (--step-pipelining auto or schedule_ahead): the same greedy tokens
as planning step by step (--step-pipelining off), requests ended by a stop token mid-pipeline
included, and every block back in the pool."""
from __future__ import annotations

import pytest
import torch
from engine_idle import wait_idle
from sharp_llama import sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams

VOCAB = 256
OPTIONS = dict(num_kv_blocks=96, max_model_len=256, max_num_seqs=8, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sharp_llama(tmp_path_factory.mktemp("sharp-llama"), vocab=VOCAB)[0]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 64, 25)]


@pytest.fixture(scope="module")
def engines(model):
    """engines(pipelining): the module's engine of that --step-pipelining mode, started once and
    shared by every run of that mode (each run starts from an empty prefix cache)."""
    started: dict[str, LLM] = {}

    def get(pipelining: str) -> LLM:
        if pipelining not in started:
            started[pipelining] = LLM(model, step_pipelining=pipelining, **OPTIONS)
        return started[pipelining]
    try:
        yield get
    finally:
        for llm in started.values():
            llm.shutdown()


@pytest.fixture
def generate(engines):
    """generate(pipelining, params): outputs and stats of the prompts on that mode's engine."""

    def run(pipelining: str, params: list[SamplingParams]):
        llm = engines(pipelining)
        llm.client.reset_prefix_cache()          # as cold as a fresh engine's
        outputs = llm.generate(prompts(), params)
        stats = wait_idle(llm.client)
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0
        return [(o.token_ids, o.finish_reason) for o in outputs], stats
    return run


@pytest.mark.timeout(300)
def test_the_same_tokens_as_step_by_step_with_stop_tokens_mid_pipeline(generate) -> None:
    lengths = [30, 45, 12, 60, 20, 50]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    step_by_step, _ = generate("off", plain)
    # Each request's 5th token becomes its stop token: it ends there, while the scheduler
    # has (where it could) already sent the next step with it.
    stopping = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                               stop_token_ids=[tokens[4]])
                for n, (tokens, _) in zip(lengths, step_by_step, strict=True)]
    expected, _ = generate("off", stopping)
    assert all(reason == "stop" for _, reason in expected)

    ahead, stats = generate("auto", plain)
    assert ahead == step_by_step
    assert stats.num_overlapped_steps == 0          # auto: schedule_ahead on CPU
    assert stats.step_wall_ms > stats.step_forward_ms > 0
    stopped, _ = generate("auto", stopping)
    assert stopped == expected


@pytest.mark.timeout(300)
def test_overlapped_workers_give_the_tokens_of_step_by_step(generate) -> None:
    """--step-pipelining overlap (forced on CPU, where auto only schedules ahead): the worker launches each
    step planned ahead before finishing the one running, its inputs taking that step's tokens
    on the device. Greedy requests, requests ended by a stop token mid-pipeline and seeded
    sampled requests must come out as planned step by step."""
    lengths = [30, 45, 12, 60, 20, 50]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    step_by_step, _ = generate("off", plain)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[tokens[6]])
              for n, (tokens, _) in zip(lengths[:3], step_by_step[:3], strict=True)]
    params += [SamplingParams(max_tokens=n, temperature=0.9, top_k=20, seed=n, ignore_eos=True)
               for n in lengths[3:]]
    expected, _ = generate("off", params)
    overlapped, stats = generate("overlap", params)
    assert overlapped == expected
    assert [reason for _, reason in overlapped[:3]] == ["stop"] * 3
    # Steps were overlapped (each of the 6 requests decodes at least 11 steps on its own),
    # and the workers timed their steps and the gaps between them.
    assert stats.num_overlapped_steps >= 10
    assert stats.device_busy_ms > 0 and stats.device_idle_ms > 0
    assert 0 < stats.device_idle_fraction < 1
