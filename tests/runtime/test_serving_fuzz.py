"""Property-based fuzzing of the HTTP request models and their translation into engine
requests: whatever JSON a client posts, the front either builds AddRequests that the scheduler
decodes, or answers with a validation or API error (a 4xx), never anything else. 3,000
generated bodies."""
from __future__ import annotations

import types

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from spmd_runtime.protocol.messages import DECODE_ERRORS, AddRequest, client_decoder
from spmd_runtime.runtime.serving.app import _completion_prompts
from spmd_runtime.runtime.serving.errors import APIError
from spmd_runtime.runtime.serving.schema import (
    AdminBatchBody,
    ChatCompletionBody,
    CompletionBody,
    chat_messages,
    check_supported,
    choice_count,
    sampling_params,
    stop_strings,
)

FUZZ = settings(max_examples=1000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
STATE = types.SimpleNamespace(tokenizer=None, info=types.SimpleNamespace(vocab_size=1000))

JSON_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)
FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
          "stop", "stream", "stream_options", "top_k", "ignore_eos", "logprobs", "echo",
          "best_of", "logit_bias", "presence_penalty", "user"]
PROMPTS = (st.text(max_size=10) | st.lists(st.integers(-5, 2**70), max_size=6)
           | st.lists(st.lists(st.integers(-5, 1200), max_size=4), max_size=3) | JSON)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]) | JSON},
    optional={"content": st.text(max_size=10) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5)}),
        max_size=2) | JSON, "name": JSON}), max_size=3) | JSON


def bodies(extra: dict) -> st.SearchStrategy:
    return st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).flatmap(
        lambda base: st.fixed_dictionaries(extra).map(lambda more: {**base, **more}))


def assert_says_what_to_change(error: APIError) -> None:
    """A refusal is a client error with a message and, where one field is at fault, its name."""
    assert error.status in (400, 404) and error.type == "invalid_request_error", vars(error)
    assert len(error.message) > 10, vars(error)
    if error.param is not None:
        assert error.param.split(".")[0] in error.message or error.param in (
            "prompt", "messages", "max_tokens", "model"), vars(error)


def to_engine(body, prompts: list[list[int]]) -> None:
    """What the front does with a body before submitting it, down to the frames it sends."""
    check_supported(body)
    stop_strings(body)
    n, candidates = choice_count(body)
    assert 1 <= n <= candidates
    for choice in range(candidates):
        for prompt in prompts:
            params = sampling_params(body, len(prompt), 256, 16, choice)
            frame = msgspec.msgpack.encode(AddRequest(tag=1, prompt_token_ids=prompt,
                                                      params=params))
            decoded = client_decoder().decode(frame)
            assert decoded.params == params


@FUZZ
@given(bodies({"prompt": PROMPTS}))
def test_completion_bodies(raw: dict) -> None:
    try:
        body = CompletionBody.model_validate(raw)
        to_engine(body, _completion_prompts(STATE, body))
    except ValidationError:
        pass        # FastAPI answers 400 with pydantic's field errors
    except APIError as error:
        assert_says_what_to_change(error)


@FUZZ
@given(bodies({"messages": MESSAGES}))
def test_chat_bodies(raw: dict) -> None:
    try:
        body = ChatCompletionBody.model_validate(raw)
        chat_messages(body)
        to_engine(body, [[1, 2, 3]])
    except ValidationError:
        pass        # FastAPI answers 400 with pydantic's field errors
    except APIError as error:
        assert_says_what_to_change(error)


@FUZZ
@given(st.dictionaries(st.sampled_from(["max_num_seqs", "force_evict", "target_temp_c",
                                        "policy", "dry_run", "other"]), JSON, max_size=5))
def test_admin_bodies(raw: dict) -> None:
    try:
        body = AdminBatchBody.model_validate(raw)
    except ValidationError:
        return
    try:
        client_decoder().decode(msgspec.msgpack.encode(["admin_batch", 1, "", *[
            getattr(body, f) for f in ("max_num_seqs", "force_evict", "target_temp_c", "policy",
                                       "dry_run")]]))
    except DECODE_ERRORS as error:
        assert str(error)     # answered with an error reply naming the problem by the scheduler
