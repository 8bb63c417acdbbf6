"""Scheduling ahead end to end (--async-scheduling, the default): the same greedy tokens as
planning step by step (--no-async-scheduling), requests ended by a stop token mid-pipeline
included, and every block back in the pool."""
from __future__ import annotations

import pytest
import torch
from engine_idle import wait_idle
from sharp_llama import sharp_llama

from runtime import LLM, SamplingParams

VOCAB = 256
OPTIONS = dict(num_kv_blocks=96, max_model_len=256, max_num_seqs=8, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sharp_llama(tmp_path_factory.mktemp("sharp-llama"), vocab=VOCAB)[0]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 64, 25)]


def generate(model, ahead: bool, params: list[SamplingParams]):
    with LLM(model, async_scheduling=ahead, **OPTIONS) as llm:
        outputs = llm.generate(prompts(), params)
        stats = wait_idle(llm.client)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0
    return [(o.token_ids, o.finish_reason) for o in outputs], stats


@pytest.mark.timeout(300)
def test_the_same_tokens_as_step_by_step_with_stop_tokens_mid_pipeline(model) -> None:
    lengths = [30, 45, 12, 60, 20, 50]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    step_by_step, _ = generate(model, False, plain)
    # Each request's 5th token becomes its stop token: it ends there, while the scheduler
    # has (where it could) already sent the next step with it.
    stopping = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                               stop_token_ids=[tokens[4]])
                for n, (tokens, _) in zip(lengths, step_by_step, strict=True)]
    expected, _ = generate(model, False, stopping)
    assert all(reason == "stop" for _, reason in expected)

    ahead, stats = generate(model, True, plain)
    assert ahead == step_by_step
    assert stats.step_wall_ms > stats.step_forward_ms > 0
    stopped, _ = generate(model, True, stopping)
    assert stopped == expected
