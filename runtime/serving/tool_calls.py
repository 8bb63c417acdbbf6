"""Tool calls in what a model wrote: OpenAI's `tool_calls` out of the text of one model family's
format, for a whole response and as streamed deltas. The parsers are named as vLLM's
`--tool-call-parser` names them:

* hermes (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text; a last block may lack its closing tag (generation stopped).
* llama3_json (Llama 3.1-3.3): the whole output is `{"name": ..., "parameters": {...}}`
  (or "arguments"), optionally after `<|python_tag|>`, calls separated by `;` or whitespace;
  an output that starts otherwise is content.
* mistral: `[TOOL_CALLS]` then a JSON list of calls (older tokenizers), or
  `[TOOL_CALLS]name[ARGS]{...}` once per call (newer ones).

A call that does not parse stays in the content as the model wrote it, so nothing is lost. The
content is stripped of surrounding whitespace, and None when nothing is left.

The whole parse is the stream fed at once: ToolCallStream decides only on text that can no
longer change the decision, so any split of a text into deltas streams the same content and
calls as the whole text parses to.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A call read off the text: the function's name and its arguments object.
_Call = tuple[str, dict]
# Turns the text of a call's JSON into its calls; None when it is no call.
_CallReader = Callable[[str], list[_Call] | None]
# One state of a scanner: consumes what it can decide on; True while it made progress.
_State = Callable[[bool], bool]


def new_call_id() -> str:
    """An id in OpenAI's shape: call_ and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


@dataclass(frozen=True)
class Delta:
    """One streamed piece of a choice: content text (index is None), or a piece of tool call
    `index`. A call's first piece has its id and name (and arguments ""); later pieces carry
    fragments of its arguments' JSON text, to be concatenated."""
    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict:
        """The `choices[i].delta` object of a streamed chat completion chunk."""
        if self.index is None:
            return {"content": self.content}
        call: dict = {"index": self.index}
        if self.id is None:
            call["function"] = {"arguments": self.arguments}
        else:
            call |= {"id": self.id, "type": "function",
                     "function": {"name": self.name, "arguments": self.arguments}}
        return {"tool_calls": [call]}


def tool_call_json(calls: Sequence[ToolCall]) -> list[dict]:
    """A whole response's `message.tool_calls`."""
    return [{"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]


def parse_tool_calls(parser: str, text: str, *,
                     call_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """The content and the tool calls of a whole output."""
    stream = ToolCallStream(parser, call_id=call_id)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(delta.content for delta in deltas if delta.index is None)
    calls: dict[int, list[str]] = {}  # index -> id, name, arguments so far
    for delta in deltas:
        if delta.index is not None:
            calls.setdefault(delta.index, [delta.id, delta.name, ""])[2] += delta.arguments
    return content or None, [ToolCall(*call) for call in calls.values()]


class ToolCallStream:
    """Turns an output's text deltas into content and tool-call deltas, for one choice. Text is
    held back only while it may still be (the start of) a call; a call's arguments come out at
    once, when its JSON is complete."""

    def __init__(self, parser: str, *, call_id: Callable[[], str] = new_call_id) -> None:
        scanner = _SCANNERS.get(parser)
        if scanner is None:
            raise ValueError(f"unknown tool call parser {parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
        self._scanner = scanner(call_id)

    def feed(self, delta: str) -> list[Delta]:
        self._scanner.pending += delta
        return self._scanner.run(final=False)

    def finish(self) -> list[Delta]:
        """What was held back, decided now that the output has ended."""
        return self._scanner.run(final=True)


class _JsonExtent:
    """Where the JSON object or array that starts a text ends, found by counting its brackets
    outside strings, without parsing: a streamed call's end is found as its text arrives, and
    a malformed one still has an end, after which the text is scanned again."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scanned = 0

    def end(self, text: str) -> int | None:
        """The end of the value in `text` (a longer text each call, same beginning), or None
        while it is not closed yet."""
        for at in range(self._scanned, len(text)):
            char = text[at]
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = char == "\\"
                self._in_string = char != '"'
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return at + 1
        self._scanned = len(text)
        return None


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_of(value: object) -> _Call | None:
    """{"name": ..., "arguments": {...}} (or "parameters", as Llama names them) as a call; no
    arguments is an empty object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def _one_call(text: str) -> list[_Call] | None:
    call = _call_of(_loads(text))
    return None if call is None else [call]


def _call_list(text: str) -> list[_Call] | None:
    value = _loads(text)
    if not isinstance(value, list) or not value:
        return None
    calls = [_call_of(item) for item in value]
    return None if None in calls else calls


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (and is shorter)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class _Scanner:
    """Reads one format's text as a state machine over the text not decided yet (`pending`).
    A call being read keeps its raw text in `attempt`: content again if the call fails.
    Each format has a state that reads content (at the start, and after a call that failed) and
    a state for what follows a call."""
    resume: _State
    after_call: _State

    def __init__(self, call_id: Callable[[], str]) -> None:
        self.pending = ""
        self.attempt = ""
        self._call_id = call_id
        self._calls = 0
        self._content_started = False
        self._held_space = ""
        self._deltas: list[Delta] = []
        self._extent = _JsonExtent()
        self._read_calls: _CallReader = _one_call
        self.state: _State = self.resume

    def run(self, final: bool) -> list[Delta]:
        while self.state(final):
            pass
        deltas, self._deltas = self._deltas, []
        return deltas

    def take(self, size: int) -> str:
        """Moves the first `size` pending characters to the call being read."""
        taken, self.pending = self.pending[:size], self.pending[size:]
        self.attempt += taken
        return taken

    def release(self, size: int) -> None:
        """The first `size` pending characters are content."""
        self.emit_content(self.pending[:size])
        self.pending = self.pending[size:]

    def emit_content(self, text: str) -> None:
        """Content goes out stripped of its surrounding whitespace, as a whole response's is:
        leading whitespace is dropped, other whitespace waits until text follows it."""
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept):]
        if kept:
            self._deltas.append(Delta(content=kept))

    def next_char(self) -> str:
        """The first pending character after whitespace, which is taken; "" when none yet."""
        self.take(len(self.pending) - len(self.pending.lstrip()))
        return self.pending[:1]

    def fail(self) -> bool:
        """The call being read is none: its text is content, and what follows is read again."""
        self.emit_content(self.attempt)
        self.attempt = ""
        self.state = self.resume
        return True

    def wait_or_fail(self, final: bool) -> bool:
        """Not decidable yet: more text may decide it, and at the end it is no call."""
        return self.fail() if final else False

    def conclude(self, calls: list[_Call] | None) -> bool:
        """The call being read turned out to be these calls, or (None) no call."""
        if calls is None:
            return self.fail()
        for name, arguments in calls:
            self._deltas.append(Delta(index=self._calls, id=self._call_id(), name=name, arguments=""))
            self._deltas.append(Delta(index=self._calls, arguments=json.dumps(arguments, ensure_ascii=False)))
            self._calls += 1
        self.attempt = ""
        self.state = self.after_call
        return True

    def start_json(self, read_calls: _CallReader) -> bool:
        """The pending text starts with a call's JSON value, which `read_calls` turns into calls."""
        self._extent = _JsonExtent()
        self._read_calls = read_calls
        self.state = self.json_value
        return True

    def json_value(self, final: bool) -> bool:
        end = self._extent.end(self.pending)
        if end is None and not final:
            return False
        return self.conclude(self._read_calls(self.take(len(self.pending) if end is None else end)))


class _MarkedScanner(_Scanner):
    """Formats whose calls start with a marker anywhere in the text, content around them. Their
    state after the marker is call_body."""
    MARKER = ""
    call_body: _State

    def resume(self, final: bool) -> bool:
        at = self.pending.find(self.MARKER)
        if at < 0:
            self.release(len(self.pending) - (0 if final else _marker_start(self.pending, self.MARKER)))
            return False
        self.release(at)
        self.take(len(self.MARKER))
        self.state = self.call_body
        return True

    after_call = resume


class _Hermes(_MarkedScanner):
    MARKER = "<tool_call>"
    END = "</tool_call>"

    def call_body(self, final: bool) -> bool:
        end = self.pending.find(self.END)
        if end < 0 and not final:
            return False
        body = self.take(len(self.pending) if end < 0 else end)
        self.take(len(self.END))  # the closing tag; nothing when the output ended without it
        return self.conclude(_one_call(body))


class _Mistral(_MarkedScanner):
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    NAME = re.compile(r"[\w.-]*")

    def __init__(self, call_id: Callable[[], str]) -> None:
        super().__init__(call_id)
        self._name = ""

    def call_body(self, final: bool) -> bool:
        first = self.next_char()
        if not first:
            return self.wait_or_fail(final)
        if first == "[":
            return self.start_json(_call_list)
        self.state = self.function_name
        return True

    def function_name(self, final: bool) -> bool:
        """`name[ARGS]`; what cannot become it makes the marker content."""
        name = self.NAME.match(self.pending).group()
        rest = self.pending[len(name):]
        if name and rest.startswith(self.ARGS):
            self._name = self.take(len(name))
            self.take(len(self.ARGS))
            self.state = self.arguments
            return True
        if self.ARGS.startswith(rest) and not final:
            return False
        self.take(len(name))
        return self.fail()

    def arguments(self, final: bool) -> bool:
        first = self.next_char()
        if not first:
            return self.wait_or_fail(final)
        return self.start_json(self._named_call) if first == "{" else self.fail()

    def _named_call(self, text: str) -> list[_Call] | None:
        arguments = _loads(text)
        return [(self._name, arguments)] if isinstance(arguments, dict) else None


class _Llama3Json(_Scanner):
    PYTHON_TAG = "<|python_tag|>"
    SEPARATORS = re.compile(r"[\s;]*")

    def __init__(self, call_id: Callable[[], str]) -> None:
        super().__init__(call_id)
        self.state = self.python_tag

    def python_tag(self, final: bool) -> bool:
        """The output's start: whitespace, then maybe <|python_tag|>."""
        self.next_char()
        if self.pending.startswith(self.PYTHON_TAG):
            self.take(len(self.PYTHON_TAG))
        elif self.PYTHON_TAG.startswith(self.pending) and not final:
            return False
        self.state = self.object_start
        return True

    def object_start(self, final: bool) -> bool:
        first = self.next_char()
        if not first:
            return self.wait_or_fail(final)
        return self.start_json(_one_call) if first == "{" else self.fail()

    def after_call(self, final: bool) -> bool:
        """Separators, then the next call; separators that end the output are no content."""
        self.take(self.SEPARATORS.match(self.pending).end())
        if final and not self.pending:
            self.attempt = ""
            return False
        return self.object_start(final)

    def resume(self, final: bool) -> bool:
        """Once the output is not (or no longer) calls, all of the rest is content."""
        self.release(len(self.pending))
        return False


_SCANNERS: dict[str, type[_Scanner]] = {
    "hermes": _Hermes, "llama3_json": _Llama3Json, "mistral": _Mistral}
TOOL_CALL_PARSERS: tuple[str, ...] = tuple(_SCANNERS)
