"""Tool calling in the front, without a server: what tool_choice asks of the engine (the
constraint that forces a call) and how replies are read into tool_calls."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
from spmd_runtime.runtime.serving.errors import APIError
from spmd_runtime.runtime.serving.structured import strict_schema
from spmd_runtime.runtime.serving.tools import ToolMode, tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now"}}


def body(tools=None, tool_choice=None, parallel_tool_calls=None):
    return SimpleNamespace(tools=tools, tool_choice=tool_choice,
                           parallel_tool_calls=parallel_tool_calls)


def ids():
    count = iter(range(100))
    return lambda: f"call_{next(count)}"


def test_without_tools_nothing_changes_and_a_tool_choice_is_refused() -> None:
    assert tool_request(body(), "hermes") == (None, None, None)
    with pytest.raises(APIError, match="tool_choice needs tools"):
        tool_request(body(tool_choice="required"), "hermes")


def test_auto_reads_with_the_parser_and_needs_one() -> None:
    tools, mode, forced = tool_request(body([WEATHER]), "hermes")
    assert mode == ToolMode("parse", parser="hermes") and forced is None
    assert tools[0]["function"]["name"] == "get_weather"
    with pytest.raises(APIError, match="--tool-call-parser") as refused:
        tool_request(body([WEATHER]), "none")
    assert refused.value.param == "tool_choice"


def test_none_leaves_the_tools_out_of_the_prompt() -> None:
    assert tool_request(body([WEATHER], "none"), "hermes") == (None, None, None)


def test_a_named_function_is_forced_to_its_strict_parameters() -> None:
    tools, mode, forced = tool_request(body([WEATHER, CLOCK], {"type": "function",
                                                                "function": {"name": "now"}}), "none")
    assert mode == ToolMode("named", name="now")
    assert forced.json == {"type": "object", "properties": {}, "additionalProperties": False}
    content, calls = mode.parse('{}', call_id=ids())
    assert content is None and [(c.id, c.name, c.arguments) for c in calls] == [("call_0", "now", "{}")]


def test_an_unknown_function_in_tool_choice_is_refused_naming_it() -> None:
    with pytest.raises(APIError, match="'nope', which is not in tools") as refused:
        tool_request(body([WEATHER], {"type": "function", "function": {"name": "nope"}}), "none")
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize("tools", [[{"type": "function"}], [{"function": {"name": 3}}],
                                   [{"type": "retrieval", "function": {"name": "x"}}],
                                   [WEATHER, WEATHER]])
def test_malformed_tools_are_refused(tools) -> None:
    with pytest.raises(APIError, match="tools"):
        tool_request(body(tools, "required"), "none")


@pytest.mark.parametrize("parallel", [None, False])
def test_required_forces_a_list_of_calls_of_the_given_tools(parallel) -> None:
    _, mode, forced = tool_request(body([WEATHER, CLOCK], "required", parallel), "none")
    schema = forced.json
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]
    bad = [[], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
           [{"name": "now", "parameters": {"extra": 1}}]]
    for calls in bad + ([good] if parallel is False else []):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    jsonschema.validate(good[:1], schema)
    if parallel is None:
        jsonschema.validate(good, schema)
    content, calls = mode.parse(json.dumps(good), call_id=ids())
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("now", {})]


def test_a_forced_reply_cut_short_is_left_as_content() -> None:
    mode = ToolMode("required")
    assert mode.parse('[{"name": "now", "param') == ('[{"name": "now", "param', [])


def test_forced_calls_stream_once_whole_as_openai_deltas() -> None:
    stream = ToolMode("named", name="get_weather").stream()
    assert stream.feed('{"city":') == [] and stream.feed(' "Oslo"}') == []
    first, arguments = (d.to_openai()["tool_calls"][0] for d in stream.finish())
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["index"] == 0
    assert json.loads(arguments["function"]["arguments"]) == {"city": "Oslo"}
    assert stream.called


def test_strict_objects_take_only_their_properties_unless_they_say_otherwise() -> None:
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}}}
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["inner"]["additionalProperties"] is False
    assert strict["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in schema            # the request's own is left alone
