"""Repetition, presence and frequency penalties and min_p: the choices of transformers' logits
processors and OpenAI's formula on fixed inputs; neutral options leave the logits untouched."""
from __future__ import annotations

import msgspec
import pytest
import torch
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.worker_proc.penalties import penalize
from spmd_runtime.worker_proc.sampler import _filtered_probs
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

VOCAB = 50


def fixed_logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 3


def test_repetition_penalty_matches_transformers() -> None:
    logits = fixed_logits(3)
    tokens = [[1, 5, 5, 9, 40], [2, 3], [7, 7, 7, 8, 11, 12, 49]]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7),
              SamplingParams(repetition_penalty=2.0)]
    got = penalize(logits, params, tokens, [2, -1, 4])
    for row, p in enumerate(params):
        reference = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            torch.tensor([tokens[row]]), logits[row:row + 1].clone())
        assert torch.allclose(got[row:row + 1], reference)


def test_presence_and_frequency_follow_openai_over_output_tokens_only() -> None:
    logits = fixed_logits(2)
    tokens = [[3, 3, 4, 4, 4, 6], [10, 11, 12]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5)]
    got = penalize(logits, params, tokens, [1, 1])
    expected = logits.clone()
    for row, p in enumerate(params):
        output = tokens[row][1:]
        for token in set(output):
            expected[row, token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    assert torch.allclose(got, expected)


def test_neutral_rows_untouched_and_unread_tokens_taken_from_the_step_in_flight() -> None:
    logits = fixed_logits(3)
    params = [SamplingParams(temperature=0.0), SamplingParams(frequency_penalty=1.0),
              SamplingParams()]
    assert penalize(logits, [params[0], params[2]], [[1], [2]], [1, 1]) is logits
    in_flight = torch.tensor([9, 21])
    got = penalize(logits, params, [[1, 2], [4, 4, -1], [5]], [1, 1, 1],
                   [None, (2, 1), None], in_flight)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    expected = logits[1].clone()
    expected[4] -= 1.0
    expected[21] -= 1.0
    assert torch.allclose(got[1], expected)


def test_min_p_matches_transformers() -> None:
    logits = fixed_logits(4)
    for row, min_p in enumerate([0.05, 0.2, 0.5, 1.0]):
        probs = _filtered_probs(logits[row], SamplingParams(temperature=0.8, min_p=min_p))
        warped = MinPLogitsWarper(min_p)(None, logits[row:row + 1] / 0.8)
        assert torch.allclose(probs, torch.softmax(warped, -1)[0])


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("min_p", 1.5), ("min_p", "x")])
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_neutral_values_stay_off_the_wire() -> None:
    plain = msgspec.msgpack.encode(SamplingParams(temperature=0.5))
    assert msgspec.msgpack.encode(SamplingParams(temperature=0.5, repetition_penalty=1.0,
                                                 min_p=0.0)) == plain
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.1).penalized
