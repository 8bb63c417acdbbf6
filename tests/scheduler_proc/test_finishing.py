"""The one place that decides when a request ends and why (scheduler_proc/finishing.py)."""
from __future__ import annotations

import time

from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.scheduler_proc.finishing import FinishRules
from spmd_runtime.scheduler_proc.request import FinishReason, Request

EOS = 2


def request(rid: int = 0, prompt_len: int = 4, arrival: int = 0, **params) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params), b"c", arrival)


def sampled(rules: FinishRules, req: Request, token: int) -> FinishReason | None:
    req.output_token_ids.append(token)
    return rules.after_token(req, token)


def test_tokens_and_length() -> None:
    rules = FinishRules([EOS], max_model_len=8)
    assert sampled(rules, request(max_tokens=5), EOS) is FinishReason.STOP
    assert sampled(rules, request(max_tokens=5, ignore_eos=True), EOS) is None
    assert sampled(rules, request(max_tokens=5, stop_token_ids=[77]), 77) is FinishReason.STOP
    capped = request(max_tokens=2)
    assert sampled(rules, capped, 50) is None
    assert sampled(rules, capped, 51) is FinishReason.LENGTH          # max_tokens
    long = request(prompt_len=7, max_tokens=100)
    assert sampled(rules, long, 50) is FinishReason.LENGTH            # the context limit


def test_text_reaching_a_stop_string_stops_it() -> None:
    assert FinishRules.after_text(True) is FinishReason.STOP
    assert FinishRules.after_text(False) is None


def test_deadlines_end_each_request_once_and_skip_reused_ids() -> None:
    rules = FinishRules([EOS], max_model_len=64)
    live = {0: request(0, arrival=1), 1: request(1, arrival=2)}
    rules.add_deadline(live[0], 0.0)
    rules.add_deadline(live[1], 0.0)
    rules.add_deadline(request(2, arrival=3), 3600.0)
    live[1] = request(1, arrival=9)         # id 1 finished and was reused by a later request
    time.sleep(0.001)
    assert [r.request_id for r in rules.past_deadline(live.get)] == [0]
    assert rules.past_deadline(live.get) == []
