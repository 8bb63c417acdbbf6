"""Structured outputs in the OpenAI front: `response_format` (OpenAI's json_object and
json_schema) and vLLM's extensions (guided_json, guided_regex, guided_choice, guided_grammar, or
one `structured_outputs` object) become the engine's StructuredOutput, checked here first so
that a bad schema, regex or grammar gets a 400 naming the request's own field before anything
is scheduled (llguidance compiles it without the tokenizer; the engine compiles it again with
it)."""
from __future__ import annotations

import llguidance
from spmd_runtime.protocol.sampling import StructuredOutput
from spmd_runtime.runtime.serving.errors import APIError
from spmd_runtime.scheduler_proc.structured_output import grammar_text

# vLLM's guided_* fields and the StructuredOutput field each one fills.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


def request_constraint(body, forced: StructuredOutput | None = None) -> StructuredOutput | None:
    """The constraint every choice of the request samples under: its own, or `forced` by its
    tool_choice (required, a named function); the two together are refused."""
    constraint = structured_output(body)
    if forced is not None and constraint is not None:
        raise APIError("tool_choice required or a named function constrains the reply itself: "
                       "drop response_format (or the guided_* field)", param="tool_choice")
    return constraint or forced


def structured_output(body) -> StructuredOutput | None:
    """The request's constraint (None: free text); APIError naming the field when it is
    malformed, does not compile, or comes with another one."""
    given = [(field, spec) for field, spec in _requested(body) if spec is not None]
    if len(given) > 1:
        raise APIError(f"{given[0][0]} and {given[1][0]} both constrain the output; send one",
                       param=given[1][0])
    if not given:
        return None
    field, spec = given[0]
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(spec))
    except (ValueError, TypeError) as problem:
        error = str(problem)
    if error and not error.startswith("WARNING"):
        raise APIError(f"{field} is not valid: {error}", param=field)
    return spec


def _requested(body):
    """(request field, StructuredOutput or None) for every field that may constrain."""
    yield "response_format", _response_format(body.response_format)
    for field, name in GUIDED_FIELDS.items():
        value = getattr(body, field)
        yield field, None if value is None else _spec(field, **{name: _choices(field, value)
                                                                if name == "choice" else value})
    outputs = body.structured_outputs
    if outputs is not None:
        if not isinstance(outputs, dict) or set(outputs) - set(STRUCTURED_FIELDS):
            raise APIError("structured_outputs takes one of json, json_object, regex, choice or "
                           f"grammar, got {outputs!r}", param="structured_outputs")
        fields = {k: v for k, v in outputs.items() if v not in (None, False)}
        if "choice" in fields:
            fields["choice"] = _choices("structured_outputs.choice", fields["choice"])
        yield "structured_outputs", _spec("structured_outputs", **fields)


def _response_format(value) -> StructuredOutput | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        described = value.get("json_schema")
        schema = described.get("schema") if isinstance(described, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema.schema")
        return _spec("response_format", json=strict_schema(schema) if described.get("strict")
                     else schema)
    raise APIError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   param="response_format.type")


def strict_schema(schema):
    """OpenAI's strict mode: objects that list their properties take no others unless the
    schema says so (what the property list means to a reader, and what ends the output)."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_schema(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        strict["additionalProperties"] = False
    return strict


def _choices(field: str, value) -> tuple:
    if isinstance(value, str) or not isinstance(value, list):
        raise APIError(f"{field} must be a list of strings", param=field)
    return tuple(value)


def _spec(field: str, **fields) -> StructuredOutput:
    try:
        return StructuredOutput(**fields)
    except (ValueError, TypeError) as error:
        raise APIError(f"{field}: {error}", param=field) from None
