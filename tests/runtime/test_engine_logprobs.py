"""logprobs and prompt_logprobs through a live engine, against transformers' float32 log_softmax
of the same logits (teacher-forced on the engine's tokens).

One engine (a sharp tiny Llama, a 16-token budget so the longer prompts are prefilled in
chunks, prefix caching on) serves every test: LLM, Client.stream and AsyncClient give the same
records, and greedy tokens do not change when logprobs are asked for.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from sharp_llama import prompts, sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams
from spmd_runtime.runtime.async_client import AsyncClient

BUDGET = 16
TOP = 5
ATOL = 1e-4
PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=TOP,
                               prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory, model = sharp_llama(tmp_path_factory.mktemp("sharp-llama"))
    with LLM(directory, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=BUDGET,
             dtype="float32", device="cpu") as llm:
        yield llm, model


@pytest.fixture(scope="module")
def outputs(engine):
    llm, _ = engine
    return llm.generate(prompts(), WITH_LOGPROBS)


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row p is the log-distribution of the token after position p."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_record(record, token_id: int, reference: torch.Tensor, where: str) -> None:
    assert record.token_id == token_id, where
    assert abs(record.logprob - reference[token_id].item()) <= ATOL, where
    values, ids = reference.topk(TOP)
    assert [token for token, _ in record.top] == ids.tolist(), where
    assert torch.allclose(torch.tensor([lp for _, lp in record.top]), values, atol=ATOL), where


@pytest.mark.timeout(240)
def test_logprobs_equal_transformers_log_softmax(engine, outputs) -> None:
    _, model = engine
    for index, (prompt, output) in enumerate(zip(prompts(), outputs, strict=True)):
        reference = reference_logprobs(model, prompt + output.token_ids)
        assert len(output.logprobs) == len(output.token_ids) == PLAIN.max_tokens
        for step, (token, record) in enumerate(zip(output.token_ids, output.logprobs,
                                                   strict=True)):
            assert_record(record, token, reference[len(prompt) - 1 + step],
                          f"prompt {index}, generated token {step}")
        # Greedy: the sampled token is the likeliest.
        assert all(record.top[0][0] == record.token_id for record in output.logprobs)


@pytest.mark.timeout(240)
def test_prompt_logprobs_across_chunks_equal_transformers(engine, outputs) -> None:
    _, model = engine
    assert max(map(len, prompts())) > 4 * BUDGET, "the longest prompt takes several chunks"
    for index, (prompt, output) in enumerate(zip(prompts(), outputs, strict=True)):
        reference = reference_logprobs(model, prompt)
        assert len(output.prompt_logprobs) == len(prompt)
        assert output.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            assert_record(output.prompt_logprobs[position], prompt[position],
                          reference[position - 1], f"prompt {index}, token {position}")


@pytest.mark.timeout(240)
def test_greedy_tokens_unchanged_and_nothing_computed_unasked(engine, outputs) -> None:
    llm, _ = engine
    plain = llm.generate(prompts(), PLAIN)
    assert [o.token_ids for o in plain] == [o.token_ids for o in outputs]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)
    only_sampled = llm.generate(prompts()[:2], SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0))
    for output in only_sampled:
        assert output.prompt_logprobs is None
        assert [len(record.token_ids) for record in output.logprobs] == [1, 1, 1]


@pytest.mark.timeout(240)
def test_client_stream_and_async_client_give_the_same_records(engine, outputs) -> None:
    """The prompts were seen before (prefix caching is on): prompt_logprobs must still cover
    every prompt token, so those requests take no cache hits."""
    llm, _ = engine
    streamed = []
    for prompt in prompts():
        deltas = list(llm.client.stream(prompt, WITH_LOGPROBS))
        assert deltas[0].prompt_logprobs is not None
        assert all(delta.prompt_logprobs is None for delta in deltas[1:])
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
        streamed.append(([r for d in deltas for r in d.logprobs], deltas[0].prompt_logprobs))

    async def run():
        async with AsyncClient(llm.config.rpc_address) as client:
            return await client.generate(prompts(), [WITH_LOGPROBS] * len(prompts()))

    from_async = asyncio.run(run())
    for expected, (logprobs, prompt_logprobs), other in zip(outputs, streamed, from_async,
                                                            strict=True):
        for got in (logprobs, other.logprobs):
            assert_same_records(got, expected.logprobs)
        for got in (prompt_logprobs, other.prompt_logprobs):
            assert got[0] is None
            assert_same_records(got[1:], expected.prompt_logprobs[1:])


def assert_same_records(got, expected) -> None:
    """The same tokens, and logprobs that differ only by batch composition (float32 sums)."""
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert torch.allclose(torch.tensor([r.logprobs for r in got]),
                          torch.tensor([r.logprobs for r in expected]), atol=ATOL)

