"""Tool calling (issue 34) through `spmdrun serve --http-port --tool-call-parser hermes`, with
the official `openai` client, smollm2 in float32 on CPU: tool_choice "required" and a named
function force calls whose arguments validate against the tool's parameters (every time, at
temperature 1.0, whole and streamed); "auto" reads the reply with the parser; tool turns go back
through the chat template; wrong tools and choices get a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import openai_client

MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
WEATHER = {"type": "object", "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 24},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
SEEDS = range(6)


@pytest.fixture(scope="module")
def oai(spmd_serve, free_port):
    port = free_port()
    server = spmd_serve("--model", MODEL, "--dtype", "float32", "--device", "cpu",
                        "--max-model-len", "1024", "--http-port", str(port),
                        "--tool-call-parser", "hermes")
    server.base_url = f"http://127.0.0.1:{port}"
    with server.serving(), openai_client(server) as client:
        yield client


def calls_of(oai, tool_choice, seed: int, stream: bool, **extra) -> tuple[list, str]:
    """([(name, arguments text)], finish reason) of one chat completion, whole or streamed."""
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                        tool_choice=tool_choice, max_tokens=120, temperature=1.0,
                                        seed=seed, stream=stream, **extra)
    if not stream:
        choice = reply.choices[0]
        return ([(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
                choice.finish_reason)
    calls: dict[int, list] = {}
    reason = None
    for chunk in reply:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, [None, ""])
                if call.function.name:
                    assert entry[0] is None and call.id, "a call's id and name come first, once"
                    entry[0] = call.function.name
                entry[1] += call.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], reason


def assert_valid(calls: list, names=tuple(PARAMETERS)) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_always_calls_with_valid_arguments(oai, stream) -> None:
    for seed in SEEDS:
        calls, reason = calls_of(oai, "required", seed, stream)
        assert reason == "tool_calls"
        assert_valid(calls)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_is_called_with_valid_arguments(oai, stream) -> None:
    for seed in SEEDS:
        calls, reason = calls_of(oai, {"type": "function", "function": {"name": "add"}}, seed, stream)
        assert reason == "tool_calls" and len(calls) == 1
        assert_valid(calls, names=("add",))


@pytest.mark.timeout(300)
def test_without_parallel_calls_required_makes_exactly_one(oai) -> None:
    for seed in SEEDS:
        calls, _ = calls_of(oai, "required", seed, False, parallel_tool_calls=False)
        assert len(calls) == 1
        assert_valid(calls)


@pytest.mark.timeout(300)
def test_auto_is_read_with_the_parser_whole_and_streamed_alike(oai) -> None:
    """smollm2 answers in prose (no <tool_call>): content, no calls, finish_reason stop."""
    whole = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                        max_tokens=24, temperature=0)
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].message.content
    streamed = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           max_tokens=24, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content


@pytest.mark.timeout(300)
def test_tool_turns_go_back_through_the_template(oai) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                        tool_choice="none", max_tokens=8, temperature=0)
    alone = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert reply.choices[0].message.content
    # The call and its result are in the prompt (the template renders both turns).
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens + 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "unknown"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}],
      "tool_choice": "required"}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_wrong_tools_and_choices_are_a_400_naming_the_field(oai, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **fields)
    assert refused.value.body["param"] == param, refused.value.body
    assert oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices
