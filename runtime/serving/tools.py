"""Tool calling in the OpenAI front: `tools` go to the chat template, `tool_choice` says how
the reply is read.

- "none" (the default without tools): no tools in the prompt, the reply is plain content.
- "auto" (the default with tools): the model decides; its reply is read with the server's
  --tool-call-parser (runtime/serving/tool_calls.py) into content and tool_calls.
- "required", or a named function: the reply is forced through structured outputs, as vLLM
  does: a JSON list of {"name", "parameters"} calls of the given tools (one, without
  parallel_tool_calls), or the named function's arguments object, in OpenAI's strict mode
  (objects take no properties beyond those they list); so the arguments always satisfy the
  tool's parameter schema, and end.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from spmd_runtime.protocol.sampling import StructuredOutput
from spmd_runtime.runtime.serving.errors import APIError
from spmd_runtime.runtime.serving.structured import strict_schema
from spmd_runtime.runtime.serving.tool_calls import (
    Delta,
    ToolCall,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
)

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """How a chat reply with tools is read: "parse" (with `parser`), "named" (the function
    `name`'s arguments) or "required" (a JSON list of calls)."""

    kind: str
    parser: str = ""
    name: str = ""

    def parse(self, text: str, call_id: Callable[[], str] = new_call_id
              ) -> tuple[str | None, list[ToolCall]]:
        if self.kind == "parse":
            return parse_tool_calls(self.parser, text, call_id=call_id)
        if self.kind == "named":
            return None, [ToolCall(call_id(), self.name, _compact(text))]
        try:
            calls = json.loads(text)
            return None, [ToolCall(call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                          for c in calls]
        except (ValueError, TypeError, KeyError):        # cut short (length): left as content
            return text, []

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """A choice's streamed deltas: the parser's as the text comes (auto), or the forced calls
    once the reply is whole (their JSON means nothing before it is complete)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.parser = ToolCallStream(mode.parser) if mode.kind == "parse" else None
        self.text: list[str] = []
        self.called = False

    def feed(self, text: str) -> list[Delta]:
        if self.parser is not None:
            return self._seen(self.parser.feed(text))
        self.text.append(text)
        return []

    def finish(self) -> list[Delta]:
        if self.parser is not None:
            return self._seen(self.parser.finish())
        content, calls = self.mode.parse("".join(self.text))
        deltas = [Delta(content=content)] if content else []
        for index, call in enumerate(calls):
            deltas += [Delta(index=index, id=call.id, name=call.name, arguments=""),
                       Delta(index=index, arguments=call.arguments)]
        return self._seen(deltas)

    def _seen(self, deltas: list[Delta]) -> list[Delta]:
        self.called = self.called or any(d.index is not None for d in deltas)
        return deltas


def tool_request(body, parser: str) -> tuple[list[dict] | None, ToolMode | None,
                                              StructuredOutput | None]:
    """(tools for the chat template, how the reply is read, the constraint that forces it) of
    a chat body; APIError naming the field when the tools or the choice are wrong."""
    tools = [_tool(index, tool) for index, tool in enumerate(body.tools or [])]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None, None, None
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise APIError("tools: two tools have one name", param="tools")
    if choice == "none":
        return None, None, None
    if choice == "auto":
        if parser == "none":
            raise APIError("tool_choice auto needs a server started with --tool-call-parser "
                           "(hermes, llama3_json or mistral); tool_choice required or a named "
                           "function work without one", param="tool_choice")
        return tools, ToolMode("parse", parser=parser), None
    if choice == "required":
        one = body.parallel_tool_calls is False
        return tools, ToolMode("required"), StructuredOutput(json=strict_schema(_calls_schema(tools, one)))
    name = _named(choice)
    if name not in names:
        raise APIError(f"tool_choice names the function {name!r}, which is not in tools "
                       f"({', '.join(names)})", param="tool_choice")
    parameters = tools[names.index(name)]["function"]["parameters"]
    return tools, ToolMode("named", name=name), StructuredOutput(json=strict_schema(parameters))


def _tool(index: int, tool) -> dict:
    """One tool as the chat template takes it, its parameters defaulted to an empty object."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise APIError(f"tools.{index} must be {{\"type\": \"function\", \"function\": "
                       "{\"name\": ..., \"parameters\": {...}}}", param=f"tools.{index}")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise APIError(f"tools.{index}.function.parameters must be a JSON schema object",
                       param=f"tools.{index}.function.parameters")
    return {"type": "function", "function": {**function, "parameters": parameters}}


def _named(choice) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")
    return function["name"]


def _calls_schema(tools: list[dict], one: bool) -> dict:
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": tool["function"]["name"]},
                             "parameters": tool["function"]["parameters"]}} for tool in tools]
    return {"type": "array", "minItems": 1, **({"maxItems": 1} if one else {}),
            "items": {"anyOf": calls}}


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text         # cut short (length): as generated

