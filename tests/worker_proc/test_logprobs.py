"""The ModelRunner's logprobs against transformers' float32 log_softmax: prompt records over
packed chunks (a mixed batch) and over a prompt graph's one-prompt-per-row layout (emulated on
CPU), sampled records with penalties and temperature applied to sampling only."""
from __future__ import annotations

import pytest
import torch
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.worker_proc.graphs import GraphCapturer
from test_graphs import BUCKETS, STRATEGIES, blocks_of, make_runner
from test_model_runner import build_pair, prompt

ATOL = 1e-4
TOP = 4
ASKS = SamplingParams(temperature=0.0, max_tokens=50, logprobs=TOP, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=3)


def reference(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_record(record, token_id: int, expected: torch.Tensor, what: str) -> None:
    values, ids = expected.topk(TOP)
    assert record.token_ids == [token_id, *ids.tolist()], what
    assert torch.allclose(torch.tensor(record.logprobs),
                          torch.cat([expected[token_id:token_id + 1], values]), atol=ATOL), what


def plan(step: int, new=(), cached=(), bucket=None) -> StepPlan:
    """new: (id, tokens, computed, scheduled, params); cached: (id, scheduled)."""
    return StepPlan(step_id=step, new_requests=[
        NewRequestData(rid, tokens, blocks_of(rid), computed, count, params, len(tokens))
        for rid, tokens, computed, count, params in new],
        cached_request_ids=[rid for rid, _ in cached],
        cached_num_scheduled_tokens=[count for _, count in cached],
        cached_new_block_ids=[[] for _ in cached], bucket=bucket)


def test_prompt_records_over_chunks_in_a_mixed_batch(pair) -> None:
    hf, model, config = pair
    runner = make_runner(model, config)
    chunked, short = prompt(20, 19), prompt(21, 5)
    prompt_records: dict[int, list] = {0: [None] * len(chunked), 1: [None] * len(short)}
    plain = SamplingParams(temperature=0.0, max_tokens=50)
    outputs = [runner.execute(plan(0, new=[(0, chunked, 0, 7, ASKS), (1, short, 0, 5, ASKS),
                                           (2, prompt(22, 6), 0, 6, plain)]))]
    outputs.append(runner.execute(plan(1, cached=[(0, 8), (1, 1), (2, 1)])))
    outputs.append(runner.execute(plan(2, cached=[(0, 4), (1, 1), (2, 1)])))
    sampled = {0: [], 1: []}
    for output in outputs:
        assert {r.request_id for r in output.logprobs} <= {0, 1}, "request 2 asked for none"
        tokens = dict(zip(output.request_ids, output.sampled_token_ids, strict=True))
        for record in output.logprobs:
            prompt_records[record.request_id][
                record.prompt_start:record.prompt_start + len(record.prompt)] = record.prompt
            if record.sampled is not None:
                assert record.sampled.token_id == tokens[record.request_id]
                sampled[record.request_id].append(record.sampled)
    for rid, tokens in ((0, chunked), (1, short)):
        records = prompt_records[rid]
        assert records[0] is None and None not in records[1:], rid
        generated = [r.token_id for r in sampled[rid]]
        expected = reference(hf, tokens + generated)
        for position in range(1, len(tokens)):
            assert_record(records[position], tokens[position], expected[position - 1],
                          f"request {rid}, prompt token {position}")
        for step, record in enumerate(sampled[rid]):
            assert_record(record, record.token_id, expected[len(tokens) - 1 + step],
                          f"request {rid}, generated token {step}")
    assert len(sampled[0]) == 1 and len(sampled[1]) == 3


def test_prompt_records_through_a_prompt_graph_layout(pair) -> None:
    hf, model, config = pair
    runner = make_runner(model, config)
    runner.graph_runner.capture_graphs(BUCKETS, 1 << 30, 0.3, STRATEGIES, lambda: 0,
                          GraphCapturer(torch.device("cpu"), emulate=True))
    prompts = {0: prompt(30, 5), 1: prompt(31, 9), 2: prompt(32, 14)}
    bucket = StepShape(Phase.PROMPT, *BUCKETS["prompt"].find(3, 14))
    assert runner.graphs.get(bucket) is not None
    output = runner.execute(plan(0, new=[(rid, tokens, 0, len(tokens), ASKS)
                                         for rid, tokens in prompts.items()], bucket=bucket))
    assert sorted(r.request_id for r in output.logprobs) == [0, 1, 2]
    for record in output.logprobs:
        tokens = prompts[record.request_id]
        expected = reference(hf, tokens)
        assert record.prompt_start == 1 and len(record.prompt) == len(tokens) - 1
        for position, entry in enumerate(record.prompt, 1):
            assert_record(entry, tokens[position], expected[position - 1],
                          f"request {record.request_id}, prompt token {position}")
        assert_record(record.sampled, record.sampled.token_id, expected[-1], "sampled")


def test_sampled_records_ignore_penalties_and_temperature(pair) -> None:
    """The raw distribution's logprobs, whatever sampling did to the logits."""
    hf, model, config = pair
    runner = make_runner(model, config)
    tokens = prompt(40, 8)
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=50, repetition_penalty=1.5,
                            presence_penalty=1.0, logprobs=0)
    output = runner.execute(plan(0, new=[(0, tokens, 0, len(tokens), params)]))
    (record,) = output.logprobs
    assert record.prompt == [] and record.sampled.token_id == output.sampled_token_ids[0]
    assert len(record.sampled.token_ids) == 1
    expected = reference(hf, tokens)[-1, record.sampled.token_id].item()
    assert abs(record.sampled.logprob - expected) <= ATOL
