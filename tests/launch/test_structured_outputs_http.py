"""Structured outputs (issue 34) through `spmdrun serve --http-port`, driven by the official
`openai` client: OpenAI's response_format (json_object, json_schema strict, and the client's
`parse` with a pydantic model) and vLLM's extensions (guided_json, guided_regex, guided_choice,
guided_grammar, structured_outputs={...}) on /v1/completions and /v1/chat/completions.

One server per module: smollm2, float32, CPU, --max-model-len 1024. Sampled requests run at
temperature 1.0 with a seed, so only the constraint keeps the outputs valid. What is proven:
every output validates (jsonschema, re.fullmatch, choice membership) and ends with "stop",
whole or streamed, with n, best_of, logprobs, stop strings and penalties too; a constraint that
cannot compile is a 400 naming its field, with nothing scheduled; 200 concurrent constrained
requests all come back 200 and valid, and the engine is idle afterwards.
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from conftest import wait_until
from pydantic import BaseModel, Field
from spmd_runtime.runtime import Client
from spmd_runtime.runtime.serving.structured import strict_schema

MAX_MODEL_LEN = 1024
MODEL = "smollm2"
PROMPT = "Here is the answer, in the requested format: "
MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "maxItems": 3,
                      "items": {"type": "string", "enum": ["english", "french", "german"]}},
        "employed": {"type": "boolean"},
        "address": {"type": "object", "required": ["city"],
                    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                   "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}}},
    },
    "required": ["name", "age", "employed"],
}


# guided_json is not strict: its schema closes its objects itself, so outputs stay short.
CLOSED_PERSON = strict_schema(PERSON)
DATE = r"\d{4}-\d{2}-\d{2}"
COLOURS = ["red", "green", "blue", "light yellow"]
# The same language twice: as GBNF (vLLM's usual spelling) and as Lark; GREETING_REGEX checks it.
GREETING_GBNF = """root ::= greeting " " name "!"
greeting ::= "hello" | "hi" | "good morning"
name ::= [A-Z] [a-z]{1,9}
"""
GREETING_LARK = """start: GREETING " " NAME "!"
GREETING: "hello" | "hi" | "good morning"
NAME: /[A-Z][a-z]{1,9}/
"""
GREETING_REGEX = r"(hello|hi|good morning) [A-Z][a-z]{1,9}!"


def check(kind: str, spec, text: str) -> None:
    """Assert `text` is in the language of a constraint of `kind` (json, json_object, regex,
    choice, grammar)."""
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise AssertionError(f"not JSON ({error}): {text!r}") from None
        if kind == "json":
            jsonschema.validate(value, json.loads(spec) if isinstance(spec, str) else spec)
        else:
            assert isinstance(value, dict), text
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    elif kind == "choice":
        assert text in spec, (spec, text)
    else:
        assert re.fullmatch(GREETING_REGEX, text), text


# (request field, its value, constraint kind and spec for check()).
EXTENSIONS = [
    pytest.param("guided_json", CLOSED_PERSON, ("json", CLOSED_PERSON), id="guided_json"),
    pytest.param("guided_json", json.dumps(CLOSED_PERSON), ("json", CLOSED_PERSON),
                 id="guided_json-text"),
    pytest.param("guided_regex", DATE, ("regex", DATE), id="guided_regex"),
    pytest.param("guided_choice", COLOURS, ("choice", COLOURS), id="guided_choice"),
    pytest.param("guided_grammar", GREETING_GBNF, ("grammar", None), id="guided_grammar-gbnf"),
    pytest.param("structured_outputs", {"json": CLOSED_PERSON}, ("json", CLOSED_PERSON),
                 id="so-json"),
    pytest.param("structured_outputs", {"regex": DATE}, ("regex", DATE), id="so-regex"),
    pytest.param("structured_outputs", {"choice": COLOURS}, ("choice", COLOURS), id="so-choice"),
    pytest.param("structured_outputs", {"grammar": GREETING_LARK}, ("grammar", None),
                 id="so-grammar-lark"),
]


@pytest.fixture(scope="module")
def server(spmd_serve, free_port):
    port = free_port()
    srv = spmd_serve("--model", MODEL, "--dtype", "float32", "--device", "cpu", "--max-model-len",
                     str(MAX_MODEL_LEN), "--http-port", str(port))
    srv.base_url = f"http://127.0.0.1:{port}"
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def wait_idle(rpc: Client):
    """Stats once nothing runs or waits and every KV block is free."""
    def idle():
        stats = rpc.stats()
        return stats if stats.num_running == stats.num_waiting == stats.kv_blocks_in_use == 0 else None
    return wait_until(idle, 120, what=lambda: f"an idle engine: {rpc.stats()}")


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


# ---------------------------------------------------------------------------- response_format

@pytest.mark.timeout(300)
def test_response_format_json_schema_strict_whole_and_streamed(oai) -> None:
    """float32, temperature 1.0: a strict json_schema chat completion is a complete JSON that
    validates against the schema with every object closed (strict), whole and streamed."""
    messages = [{"role": "user", "content": "Describe a fictional person as JSON."}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                        temperature=1.0, seed=7, response_format=person_format())
    (choice,) = reply.choices
    assert choice.finish_reason == "stop", choice.message.content
    check("json", CLOSED_PERSON, choice.message.content)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                              temperature=1.0, seed=8, stream=True,
                                              response_format=person_format()))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    check("json", CLOSED_PERSON, text)


@pytest.mark.timeout(300)
def test_response_format_json_object_is_a_json_object(oai) -> None:
    """float32, greedy: json_object gives one complete JSON object, on chat and completions."""
    messages = [{"role": "user", "content": "Give a JSON object for a cat named Tom, aged 3, "
                                            "with keys name and age."}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                        temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    check("json_object", None, reply.choices[0].message.content)
    # A one-shot prompt: asked bare, greedy SmolLM2 repeats keys until max_tokens.
    prompt = 'Cat: Tom, 3 years old.\nJSON: {"name": "Tom", "age": 3}\nDog: Rex, 5 years old.\nJSON: '
    reply = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=200, temperature=0,
                                   extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].finish_reason == "stop"
    check("json_object", None, reply.choices[0].text)


class City(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    country: str = Field(min_length=1, max_length=20)
    population_millions: int = Field(ge=0, le=40)
    capital: bool


@pytest.mark.timeout(300)
def test_parse_with_a_pydantic_model_returns_the_object(oai) -> None:
    """float32, temperature 1.0: the openai client's `parse` (strict schema of a pydantic model)
    gets a reply it parses into that model."""
    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    completion = parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                       response_format=City, max_tokens=150, temperature=1.0, seed=3)
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed == City.model_validate_json(choice.message.content)


# ---------------------------------------------------------------------------- vLLM's extensions

@pytest.mark.timeout(300)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("field", "value", "expected"), EXTENSIONS)
def test_vllm_extensions_constrain_the_output(oai, endpoint, field, value, expected) -> None:
    """float32, temperature 1.0: each of vLLM's spellings constrains /v1/completions and
    /v1/chat/completions; the output is complete and in the constraint's language."""
    options = {"max_tokens": 200 if expected[0] == "json" else 40, "temperature": 1.0, "seed": 5,
               "extra_body": {field: value}}
    if endpoint == "completions":
        (choice,) = oai.completions.create(model=MODEL, prompt=PROMPT, **options).choices
        text = choice.text
    else:
        (choice,) = oai.chat.completions.create(model=MODEL, messages=MESSAGES, **options).choices
        text = choice.message.content
    assert choice.finish_reason == "stop", text
    check(*expected, text)


@pytest.mark.timeout(300)
def test_n_best_of_logprobs_stop_strings_and_penalties_still_validate(oai) -> None:
    """float32, temperature 1.0: n=2 of best_of=3 completions and n=3 chat choices, with
    logprobs, an unreachable stop string and penalties, all validate; a stop string the
    constraint reaches cuts the text before it ("stop")."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.5}
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=1.0,
                                   seed=21, n=2, best_of=3, logprobs=2, stop=["@@"],
                                   extra_body={"guided_json": CLOSED_PERSON, "repetition_penalty": 1.2},
                                   **penalties)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        check("json", CLOSED_PERSON, choice.text)
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) > 0
        # The legacy shape lists the top 2 and the chosen token.
        assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200,
                                        temperature=1.0, seed=22, n=3, logprobs=True, top_logprobs=2,
                                        stop=["@@"], response_format=person_format(), **penalties)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        check("json", CLOSED_PERSON, choice.message.content)
        assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    reply = oai.completions.create(model=MODEL, prompt="Pick one: ", max_tokens=16, temperature=1.0,
                                   seed=23, n=3, stop=[";"],
                                   extra_body={"guided_choice": ["red;1", "blue;2"]})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.text in ("red", "blue"), choice.text


# ---------------------------------------------------------------------------- refusals

BAD_REQUESTS = [
    pytest.param("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "nonsense"}, "strict": True}}}, "response_format",
        id="response_format-schema"),
    pytest.param("chat", {"response_format": {"type": "xml"}}, "response_format",
                 id="response_format-type"),
    pytest.param("completions", {"guided_json": {"type": "nonsense"}}, "guided_json",
                 id="guided_json"),
    pytest.param("completions", {"guided_regex": "(unclosed"}, "guided_regex", id="guided_regex"),
    pytest.param("chat", {"guided_regex": "(unclosed"}, "guided_regex", id="guided_regex-chat"),
    pytest.param("chat", {"guided_grammar": "start: undefined_rule"}, "guided_grammar",
                 id="guided_grammar"),
    pytest.param("completions", {"guided_choice": []}, "guided_choice", id="guided_choice-empty"),
    pytest.param("completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs",
                 id="structured_outputs-regex"),
    pytest.param("chat", {"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs",
                 id="structured_outputs-json"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("endpoint", "fields", "name"), BAD_REQUESTS)
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(http, rpc, oai, endpoint,
                                                                    fields, name) -> None:
    """float32: an invalid schema, a regex or grammar that cannot compile, a malformed
    response_format: HTTP 400 whose message names the field, nothing scheduled; then a normal
    request succeeds."""
    before = wait_idle(rpc)
    body = {"model": MODEL, "max_tokens": 8, **fields}
    body.update({"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES})
    reply = http.post("/v1/completions" if endpoint == "completions" else "/v1/chat/completions",
                      json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert name in error["message"], error
    after = wait_idle(rpc)
    assert (after.num_finished, after.num_prompt_tokens) == (before.num_finished,
                                                             before.num_prompt_tokens)
    with pytest.raises(openai.BadRequestError, match=name):
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=fields)
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


# ---------------------------------------------------------------------------- load

CONCURRENT = 200


def small_schema(index: int) -> dict:
    """One of 10 distinct closed schemas whose instances are at most about 40 characters."""
    words = ["yes", "no", "maybe", "later", "never", "always"]
    return {"type": "object", "additionalProperties": False, "required": ["answer", "score"],
            "properties": {"answer": {"type": "string", "enum": words[index % 5:index % 5 + 2]},
                           "score": {"type": "integer", "minimum": 0, "maximum": 5 + index % 10},
                           "sure": {"type": "boolean"}}}


def load_request(index: int) -> tuple[str, dict, tuple]:
    """(endpoint, openai create() arguments, (kind, spec) for check()) of request `index`:
    chat json_schema, completions guided_json, guided_regex, guided_choice and structured_outputs
    regex in turn."""
    common = {"model": MODEL, "max_tokens": 60, "temperature": 1.0, "seed": index}
    schema = small_schema(index)
    match index % 5:
        case 0:
            return "chat", {**common, "messages": MESSAGES, "response_format": {
                "type": "json_schema", "json_schema": {"name": f"s{index % 10}", "schema": schema,
                                                       "strict": True}}}, ("json", schema)
        case 1:
            return "completions", {**common, "prompt": PROMPT,
                                   "extra_body": {"guided_json": schema}}, ("json", schema)
        case 2:
            return "completions", {**common, "prompt": "Date: ",
                                   "extra_body": {"guided_regex": DATE}}, ("regex", DATE)
        case 3:
            return "chat", {**common, "messages": MESSAGES,
                            "extra_body": {"guided_choice": COLOURS}}, ("choice", COLOURS)
        case _:
            regex = r"[a-z]{1,8}-[0-9]{1,4}"
            return "completions", {**common, "prompt": "Code: ",
                                   "extra_body": {"structured_outputs": {"regex": regex}}}, ("regex", regex)


async def _send_all(base_url: str) -> list:
    """Every load request at once; (status, finish_reason, text) each, or the exception."""
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300,
                                  max_retries=0) as client:
        async def one(index: int):
            endpoint, arguments, _ = load_request(index)
            if endpoint == "chat":
                raw = await client.chat.completions.with_raw_response.create(**arguments)
                (choice,) = raw.parse().choices
                return raw.status_code, choice.finish_reason, choice.message.content
            raw = await client.completions.with_raw_response.create(**arguments)
            (choice,) = raw.parse().choices
            return raw.status_code, choice.finish_reason, choice.text
        return await asyncio.gather(*(one(i) for i in range(CONCURRENT)), return_exceptions=True)


@pytest.mark.timeout(600)
def test_two_hundred_concurrent_constrained_requests_all_complete_valid(server, rpc) -> None:
    """float32, temperature 1.0: 200 constrained requests at once (json_schema, guided_json,
    guided_regex, guided_choice, structured_outputs; 10 distinct schemas) all come back 200,
    complete and valid; each finished exactly once, and the engine is idle afterwards."""
    before = wait_idle(rpc)
    results = asyncio.run(_send_all(server.base_url))
    failures = []
    for index, result in enumerate(results):
        try:
            if isinstance(result, BaseException):
                raise result
            status, finish_reason, text = result
            assert status == 200 and finish_reason == "stop", (status, finish_reason, text)
            check(*load_request(index)[2], text)
        except Exception as error:      # noqa: BLE001 -- collected, reported together below
            failures.append(f"request {index}: {type(error).__name__}: {str(error)[:200]}")
    assert not failures, f"{len(failures)} of {CONCURRENT} failed:\n" + "\n".join(failures[:20])
    after = wait_idle(rpc)
    assert after.num_finished - before.num_finished == CONCURRENT
