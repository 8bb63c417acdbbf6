"""The tool-call parsers (hermes, llama3_json, mistral) on canned model outputs: the whole parse
is what the format says, and streaming the output, split anywhere, gives the same content and
calls as the whole parse, read back as an OpenAI client reads a stream's deltas."""
from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from spmd_runtime.runtime.serving.tool_calls import (
    TOOL_CALL_PARSERS,
    Delta,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
    tool_call_json,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
WEATHER_CALL = ("get_weather", '{"city": "Paris"}')
TIME_CALL = ("get_time", '{"zone": "UTC"}')
UNICODE_ARGS = '{"city": "Zürich", "note": "天気 ☀", "escaped": "caf\\u00e9"}'
UNICODE_CALL = ("get_weather", '{"city": "Zürich", "note": "天気 ☀", "escaped": "café"}')
# Brackets and quotes inside strings, arrays of objects, literals.
NESTED_ARGS = ('{"query": {"tags": ["a", "b"], "range": {"min": 1, "max": [2.5, null]}}, '
               '"code": "if (x) { y(\\"}\\"); } [", "rows": [{"ok": true}, {"ok": false}]}')
NESTED_CALL = ("search", NESTED_ARGS)  # written as json.dumps writes it, so it comes back as it was
PLAIN = "Use a < b, [x] or {y}; <tool> and [TOOL] are not calls."


def hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


HERMES = [
    ("one call", hermes(WEATHER), None, [WEATHER_CALL]),
    ("two calls", hermes(WEATHER) + "\n" + hermes(TIME), None, [WEATHER_CALL, TIME_CALL]),
    ("content before", "Let me check.\n" + hermes(WEATHER), "Let me check.", [WEATHER_CALL]),
    ("content after", hermes(WEATHER) + "\nDone.", "Done.", [WEATHER_CALL]),
    ("plain text", f"  {PLAIN}\n", PLAIN, []),
    ("unicode", hermes('{"name": "get_weather", "arguments": ' + UNICODE_ARGS + "}"), None, [UNICODE_CALL]),
    ("nested", hermes('{"name": "search", "arguments": ' + NESTED_ARGS + "}"), None, [NESTED_CALL]),
    ("marker in a string", hermes('{"name": "echo", "arguments": {"text": "<tool_call>"}}'), None,
     [("echo", '{"text": "<tool_call>"}')]),
    ("no arguments", hermes('{"name": "now"}'), None, [("now", "{}")]),
    ("unclosed last block", "<tool_call>\n" + WEATHER, None, [WEATHER_CALL]),
    ("malformed", "Hi " + hermes('{"name": "f", "arguments": {"a": 1}'), "Hi " + hermes(
        '{"name": "f", "arguments": {"a": 1}'), []),
    ("malformed then valid", hermes("{oops}") + hermes(TIME), hermes("{oops}"), [TIME_CALL]),
    ("unclosed malformed", "<tool_call>\n{", "<tool_call>\n{", []),
    ("arguments not an object", hermes('{"name": "f", "arguments": [1]}'),
     hermes('{"name": "f", "arguments": [1]}'), []),
]

LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_JSON = [
    ("one call", LLAMA_WEATHER, None, [WEATHER_CALL]),
    ("python tag", "<|python_tag|>" + LLAMA_WEATHER, None, [WEATHER_CALL]),
    ("two calls", f" <|python_tag|> {LLAMA_WEATHER}; {TIME};\n", None, [WEATHER_CALL, TIME_CALL]),
    ("calls on lines", f"{LLAMA_WEATHER}\n{TIME}", None, [WEATHER_CALL, TIME_CALL]),
    ("content before", "Sure: " + LLAMA_WEATHER, "Sure: " + LLAMA_WEATHER, []),
    ("content after", LLAMA_WEATHER + "\nThat is all.", "That is all.", [WEATHER_CALL]),
    ("plain text", PLAIN, PLAIN, []),
    ("plain JSON", ' {"answer": [42]} ', '{"answer": [42]}', []),
    ("tag alone", "<|python_tag|>", "<|python_tag|>", []),
    ("tag before code", '<|python_tag|>brave_search.call(query="x")',
     '<|python_tag|>brave_search.call(query="x")', []),
    ("unicode", '{"name": "get_weather", "parameters": ' + UNICODE_ARGS + "}", None, [UNICODE_CALL]),
    ("nested", '{"name": "search", "parameters": ' + NESTED_ARGS + "}", None, [NESTED_CALL]),
    ("malformed", '{"name": "f" "parameters": {}}', '{"name": "f" "parameters": {}}', []),
    ("unclosed", '{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
    ("valid then malformed", LLAMA_WEATHER + '; {"name": "b", "parameters": {',
     '; {"name": "b", "parameters": {', [WEATHER_CALL]),
]


def mistral_v11(name: str, arguments: str) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{arguments}"


MISTRAL_WEATHER = mistral_v11("get_weather", '{"city": "Paris"}')
MISTRAL_TIME = mistral_v11("get_time", '{"zone": "UTC"}')


MISTRAL = [
    ("list, one call", f"[TOOL_CALLS] [{WEATHER}]", None, [WEATHER_CALL]),
    ("list, two calls", f"[TOOL_CALLS][{WEATHER}, {TIME}]", None, [WEATHER_CALL, TIME_CALL]),
    ("one call", MISTRAL_WEATHER, None, [WEATHER_CALL]),
    ("two calls", MISTRAL_WEATHER + MISTRAL_TIME,
     None, [WEATHER_CALL, TIME_CALL]),
    ("content before", "Checking.\n" + MISTRAL_WEATHER, "Checking.",
     [WEATHER_CALL]),
    ("content before a list", f"On it. [TOOL_CALLS] [{TIME}]", "On it.", [TIME_CALL]),
    ("plain text", PLAIN + " [TOOL_CALLS", PLAIN + " [TOOL_CALLS", []),
    ("unicode", mistral_v11("get_weather", UNICODE_ARGS), None, [UNICODE_CALL]),
    ("nested", mistral_v11("search", NESTED_ARGS), None, [NESTED_CALL]),
    ("unicode, list", '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + UNICODE_ARGS + "}]", None,
     [UNICODE_CALL]),
    ("no call after the marker", "[TOOL_CALLS] sorry, no tool.", "[TOOL_CALLS] sorry, no tool.", []),
    ("marker alone", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("no name", "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", []),
    ("malformed", mistral_v11("f", '{"a": 1,}'), mistral_v11("f", '{"a": 1,}'), []),
    ("malformed then valid", mistral_v11("f", '{"a": 1,}') + MISTRAL_TIME,
     mistral_v11("f", '{"a": 1,}'), [TIME_CALL]),
    ("unclosed list", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]',
     '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]', []),
    ("list of no calls", '[TOOL_CALLS] [{"a": 1}]', '[TOOL_CALLS] [{"a": 1}]', []),
]

CASES = [pytest.param(parser, text, content, calls, id=f"{parser}: {name}")
         for parser, cases in (("hermes", HERMES), ("llama3_json", LLAMA3_JSON), ("mistral", MISTRAL))
         for name, text, content, calls in cases]

Parsed = tuple[str | None, list[tuple[str, str]]]


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def whole(parser: str, text: str) -> Parsed:
    content, calls = parse_tool_calls(parser, text, call_id=counting_ids())
    assert [call.id for call in calls] == [f"call_{i:024x}" for i in range(len(calls))]
    return content, [(call.name, call.arguments) for call in calls]


def streamed(parser: str, pieces: list[str]) -> Parsed:
    """Reads the stream's deltas as an OpenAI client does: content concatenated, each call's name
    from its first delta (which has id and type), arguments from all its deltas concatenated."""
    stream = ToolCallStream(parser)
    deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
    content, calls = "", {}
    for delta in (delta.to_openai() for delta in deltas):
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        [call] = delta["tool_calls"]
        function = call["function"]
        if call["index"] not in calls:
            assert call["index"] == len(calls) and call["type"] == "function" and call["id"]
            calls[call["index"]] = [function["name"], ""]
        else:
            assert set(call) == {"index", "function"} and set(function) == {"arguments"}
        calls[call["index"]][1] += function["arguments"]
    return content or None, [tuple(call) for call in calls.values()]


def splits(text: str) -> Iterator[list[str]]:
    """The text whole, in two pieces at every position, and character by character."""
    yield [text]
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    yield list(text)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_output(parser: str, text: str, content: str | None, calls: list) -> None:
    assert whole(parser, text) == (content, calls)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_stream_split_anywhere_equals_whole(parser: str, text: str, content: str | None, calls: list) -> None:
    for pieces in splits(text):
        assert streamed(parser, pieces) == (content, calls), pieces


def contents(deltas: list[Delta]) -> str:
    return "".join(delta.content for delta in deltas)


@pytest.mark.parametrize("parser, first, held_back, second", [
    ("hermes", "Hi <tool_c", " <tool_c", "all me"), ("hermes", "a<b", "", " c"),
    ("mistral", "Hi [TOOL_CA", " [TOOL_CA", "RDS] me"), ("mistral", "x [1] {y}", "", " z"),
    ("llama3_json", "<|python", "<|python", " is a tag")])
def test_content_held_back_only_while_it_may_start_a_call(parser: str, first: str, held_back: str,
                                                          second: str) -> None:
    stream = ToolCallStream(parser)
    assert contents(stream.feed(first)) == first.removesuffix(held_back)
    assert contents(stream.feed(second)) == held_back + second
    assert stream.finish() == []


def test_call_streams_its_name_first_then_its_arguments() -> None:
    stream = ToolCallStream("hermes", call_id=lambda: "call_1")
    assert stream.feed("<tool_call>" + WEATHER[:20]) == []
    assert [delta.to_openai() for delta in stream.feed(WEATHER[20:] + "</tool_call>")] == [
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]
    assert stream.finish() == []


def test_message_tool_calls_json() -> None:
    assert tool_call_json([ToolCall("call_1", "get_time", "{}")]) == [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert Delta(content="Hi").to_openai() == {"content": "Hi"}


def test_default_ids_are_openai_shaped_and_unique() -> None:
    _, calls = parse_tool_calls("hermes", hermes(WEATHER) * 2)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    assert calls[0].id != calls[1].id


def test_unknown_parser_names_the_known_ones() -> None:
    assert TOOL_CALL_PARSERS == ("hermes", "llama3_json", "mistral")
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        ToolCallStream("pythonic")
    with pytest.raises(ValueError, match="'pythonic'"):
        parse_tool_calls("pythonic", "text")


def test_module_does_not_import_torch() -> None:
    code = ("import sys, spmd_runtime.runtime.serving.tool_calls\n"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


FRAGMENTS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<tool", "[TOOL",
             "{", "}", "[", "]", '"', "\\", ";", ":", ",", " ", "\n", '"name"', '"arguments"', "f", "1", "é",
             hermes(TIME), LLAMA_WEATHER, MISTRAL_TIME)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_stream_split_anywhere_equals_whole_on_random_texts(parser: str) -> None:
    """Texts of format fragments, mostly not well formed: the invariant beyond the canned cases."""
    rng = random.Random(parser)
    for _ in range(300):
        text = "".join(rng.choices(FRAGMENTS, k=rng.randint(0, 12)))
        expected = whole(parser, text)
        for pieces in splits(text):
            assert streamed(parser, pieces) == expected, pieces
