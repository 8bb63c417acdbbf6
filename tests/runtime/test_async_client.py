"""AsyncClient.generate against a live engine: a batch is admitted together, not one request per
step, and a refused prompt says which one it was without leaving the others running."""
from __future__ import annotations

import asyncio

import pytest
import torch
from engine_idle import wait_idle
from sharp_llama import sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams
from spmd_runtime.runtime.async_client import AsyncClient

VOCAB = 256
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = sharp_llama(tmp_path_factory.mktemp("sharp-llama"), vocab=VOCAB)[0]
    with LLM(model, num_kv_blocks=128, max_model_len=128, max_num_seqs=16, dtype="float32",
             device="cpu") as engine:
        yield engine


def prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (6,), generator=g).tolist() for _ in range(count)]


def generate(llm: LLM, token_lists: list[list[int]]):
    async def run():
        async with AsyncClient(llm.config.rpc_address) as client:
            return await client.generate(token_lists, [PARAMS] * len(token_lists))
    return asyncio.run(run())


@pytest.mark.timeout(120)
def test_a_batch_is_admitted_together(llm) -> None:
    before = llm.client.stats()
    outputs = generate(llm, prompts(12))
    steps = wait_idle(llm.client).num_steps - before.num_steps
    assert [len(o.token_ids) for o in outputs] == [3] * 12
    # 12 requests of 3 tokens: a prompt step, then 2 decode steps, once all are admitted (a
    # step or two more if the first arrivals started a step before the rest came in).
    # Awaiting each acceptance before sending the next admitted one request per step: 14+.
    assert steps <= 6, steps
    # The same tokens as the synchronous client's batch.
    assert [o.token_ids for o in outputs] == [o.token_ids for o in llm.generate(prompts(12),
                                                                                PARAMS)]


@pytest.mark.timeout(120)
def test_a_refused_prompt_is_named_and_the_rest_are_aborted(llm) -> None:
    batch = prompts(4)
    batch[2] = [VOCAB + 5]          # outside the vocabulary
    with pytest.raises(ValueError, match="prompt 2"):
        generate(llm, batch)
    stats = wait_idle(llm.client)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
