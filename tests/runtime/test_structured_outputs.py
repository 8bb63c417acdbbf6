"""Structured outputs (issue 34) through the in-process API, on one float32 SmolLM2 engine on CPU.

What is proven: every token the engine samples for a constrained request is one the constraint
allows, and the request ends (finish_reason "stop") as soon as the constraint is complete. So
at temperature 1.0 -- where an unconstrained 135M model wanders off at once -- every output of
50 JSON schemas parses and validates (jsonschema), every regex output fullmatches, every choice
output is one of the choices and every grammar output is a sentence of the grammar. Masking
never disturbs the requests that share a batch with it, never changes a greedy output the
constraint allows anyway, and a constraint that cannot compile is refused (ValueError or
EngineError, naming the field) without harming the engine.

The 50 schemas are built from a few blocks (bounded strings, enums, bounded integers and
numbers, booleans, bounded arrays, nested objects) by a seeded generator: deterministic, and
each schema's longest valid instance is short (MAX_INSTANCE_CHARS compact characters) so that
a completed JSON fits comfortably in MAX_JSON_TOKENS. test_the_fifty_schemas_are_valid_and_bounded
checks that about the schemas themselves, without an engine.
"""
from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

import jsonschema
import pytest
from conftest import wait_until
from spmd_runtime.runtime import LLM, EngineError, SamplingParams, StructuredOutput

MAX_MODEL_LEN = 1024
MAX_JSON_TOKENS = 400
MAX_INSTANCE_CHARS = 240
NUM_SCHEMAS = 50
SEEDS = (11, 22, 33)


# ---------------------------------------------------------------------------- the 50 schemas

ENUM_WORDS = ("red", "green", "blue", "small", "large", "north", "south", "open", "closed",
              "alpha", "beta", "gamma")
FIELD_NAMES = ("name", "city", "color", "size", "count", "score", "price", "active", "tags",
               "owner", "level", "rating", "enabled", "notes", "kind", "code", "items", "limits")


def string_block(rng: random.Random) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": rng.choice((6, 10, 14, 20))}


def enum_block(rng: random.Random) -> dict:
    return {"type": "string", "enum": rng.sample(ENUM_WORDS, rng.randint(2, 4))}


def integer_block(rng: random.Random) -> dict:
    low = rng.randrange(-100, 100, 10)
    return {"type": "integer", "minimum": low, "maximum": low + rng.choice((9, 99, 999))}


def number_block(rng: random.Random) -> dict:
    # multipleOf (a power of two, exact in binary) bounds the digits after the point as well.
    low = rng.randrange(-50, 50, 5)
    return {"type": "number", "minimum": low, "maximum": low + rng.choice((1, 10, 100)),
            "multipleOf": rng.choice((0.5, 0.25))}


def boolean_block(rng: random.Random) -> dict:
    return {"type": "boolean"}


SCALAR_BLOCKS: tuple[Callable[[random.Random], dict], ...] = (
    string_block, enum_block, integer_block, number_block, boolean_block)


def object_block(rng: random.Random, fields: int, depth: int) -> dict:
    """An object of `fields` properties (closed: additionalProperties false), some required.
    At depth 0 its properties may be arrays or objects themselves; deeper only scalars."""
    kinds = list(SCALAR_BLOCKS) + ([array_block, nested_object_block] if depth == 0 else [])
    names = rng.sample(FIELD_NAMES, fields)
    properties = {}
    for position, name in enumerate(names):
        kind = kinds[(rng.randrange(len(kinds)) + position) % len(kinds)]
        properties[name] = kind(rng) if kind in SCALAR_BLOCKS else kind(rng, depth + 1)
    required = [name for name in names if rng.random() < 0.6] or names[:1]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def array_block(rng: random.Random, depth: int) -> dict:
    items = (object_block(rng, rng.randint(1, 2), depth) if rng.random() < 0.3
             else rng.choice(SCALAR_BLOCKS)(rng))
    return {"type": "array", "items": items, "minItems": rng.choice((0, 1)),
            "maxItems": rng.randint(1, 4)}


def nested_object_block(rng: random.Random, depth: int) -> dict:
    return object_block(rng, rng.randint(1, 3), depth)


def json_schema(index: int) -> dict:
    """Schema number `index`: a closed object of 2 to 5 properties drawn from the blocks with
    random.Random(index); properties are dropped from the end until its longest valid instance
    is at most MAX_INSTANCE_CHARS compact characters."""
    rng = random.Random(index)
    schema = object_block(rng, 2 + index % 4, depth=0)
    schema["title"] = f"record{index}"
    while len(compact(longest_instance(schema))) > MAX_INSTANCE_CHARS:
        last = list(schema["properties"])[-1]
        del schema["properties"][last]
        schema["required"] = [n for n in schema["required"] if n != last] or list(schema["properties"])[:1]
    return schema


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _instance(schema: dict, longest: bool):
    """The smallest (required properties, minItems, minimum, minLength) or the longest (every
    property, maxItems, widest number, maxLength) instance of a schema built from the blocks."""
    kind = schema["type"]
    if "enum" in schema:
        return max(schema["enum"], key=len) if longest else schema["enum"][0]
    if kind == "string":
        return "x" * schema["maxLength" if longest else "minLength"]
    if kind in ("integer", "number"):
        if not longest:
            return schema["minimum"]
        # The widest number is a bound, or one step inside it (the fraction digits).
        low, high, step = schema["minimum"], schema["maximum"], schema.get("multipleOf", 1)
        return max((low, high, low + step, high - step), key=lambda n: len(json.dumps(n)))
    if kind == "boolean":
        return False if longest else True
    if kind == "array":
        return [_instance(schema["items"], longest)] * schema["maxItems" if longest else "minItems"]
    names = schema["properties"] if longest else schema["required"]
    return {name: _instance(schema["properties"][name], longest) for name in names}


def longest_instance(schema: dict):
    return _instance(schema, longest=True)


def smallest_instance(schema: dict):
    return _instance(schema, longest=False)


SCHEMAS = [json_schema(index) for index in range(NUM_SCHEMAS)]


def block_kinds(schema: dict) -> set[str]:
    """Which blocks a schema uses ("enum", "string", "integer", ..., "nested array", ...)."""
    kind = "enum" if "enum" in schema else schema["type"]
    found = {kind}
    if kind == "array":
        found |= block_kinds(schema["items"]) | {f"array of {schema['items']['type']}"}
    if kind == "object":
        for sub in schema["properties"].values():
            found |= block_kinds(sub)
            if sub["type"] in ("object", "array"):
                found.add(f"nested {sub['type']}")
        if set(schema["required"]) != set(schema["properties"]):
            found.add("optional property")
    return found


def json_prompt(schema: dict) -> list[dict]:
    """A short chat prompt (the keys, not the whole schema: the constraint carries the rest)."""
    return [{"role": "user", "content": "Reply with one JSON object, nothing else, with the keys "
                                        f"{', '.join(schema['properties'])}."}]


def sampled(seed: int, structured: StructuredOutput, max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                          structured_output=structured, **options)


def greedy(max_tokens: int, structured: StructuredOutput | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=structured)


def assert_valid_json(output, schema: dict) -> dict:
    """The output ended on its own (the schema was complete), parses and validates."""
    assert output.finish_reason == "stop", (output.finish_reason, output.text)
    try:
        value = json.loads(output.text)
    except json.JSONDecodeError as error:
        raise AssertionError(f"not JSON ({error}): {output.text!r}") from None
    jsonschema.validate(value, schema)
    return value


def assert_idle(llm: LLM) -> None:
    """Nothing running or waiting and every KV block free (aborts land within a step or two)."""
    def idle():
        stats = llm.client.stats()
        return stats.num_running == stats.num_waiting == stats.kv_blocks_in_use == 0
    wait_until(idle, 60, what=lambda: f"an idle engine: {llm.client.stats()}")


# ---------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def llm():
    with LLM("smollm2", dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


def test_the_fifty_schemas_are_valid_and_bounded() -> None:
    """No engine: each generated schema is a valid JSON schema (draft 2020-12) whose smallest
    and longest instances validate, the longest at most MAX_INSTANCE_CHARS characters; the
    schemas are distinct, deterministic, and together use every block."""
    assert len({compact(s) for s in SCHEMAS}) == NUM_SCHEMAS
    assert [compact(json_schema(i)) for i in range(NUM_SCHEMAS)] == [compact(s) for s in SCHEMAS]
    used = set()
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(smallest_instance(schema), schema)
        jsonschema.validate(longest_instance(schema), schema)
        assert len(compact(longest_instance(schema))) <= MAX_INSTANCE_CHARS
        with pytest.raises(jsonschema.ValidationError):     # closed objects
            jsonschema.validate({**smallest_instance(schema), "extra": 1}, schema)
        used |= block_kinds(schema)
    assert used >= {"string", "enum", "integer", "number", "boolean", "array", "object",
                    "nested array", "nested object", "array of object", "optional property"}


@pytest.mark.timeout(600)
def test_fifty_json_schemas_at_temperature_one_all_validate(llm) -> None:
    """float32, temperature 1.0, a seed per request, all 50 in one batch: every output is
    complete (finish_reason "stop"), parses, and validates against its schema."""
    params = [sampled(1000 + i, StructuredOutput(json=schema), MAX_JSON_TOKENS)
              for i, schema in enumerate(SCHEMAS)]
    outputs = llm.chat([json_prompt(schema) for schema in SCHEMAS], params)
    failures = []
    for index, (output, schema) in enumerate(zip(outputs, SCHEMAS, strict=True)):
        try:
            assert_valid_json(output, schema)
        except (AssertionError, jsonschema.ValidationError) as error:
            failures.append(f"schema {index}: {str(error)[:300]}")
    assert not failures, "\n".join(failures)
    # The schema may be given as JSON text too.
    (again,) = llm.chat([json_prompt(SCHEMAS[0])],
                        sampled(1000, StructuredOutput(json=json.dumps(SCHEMAS[0])), MAX_JSON_TOKENS))
    assert again.text == outputs[0].text


REGEXES = {
    "date": (r"\d{4}-\d{2}-\d{2}", "Today's date in ISO format (YYYY-MM-DD) is "),
    "email": (r"[a-z]{1,10}\.[a-z]{1,10}@[a-z]{2,8}\.(com|org|net)",
              "The support team's email address is "),
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "Call our office at the phone number "),
}


@pytest.mark.timeout(300)
def test_regex_outputs_fullmatch_at_temperature_one(llm) -> None:
    """float32, temperature 1.0 x 3 seeds x 3 patterns: re.fullmatch holds for every output."""
    cases = [(name, seed) for name in REGEXES for seed in SEEDS]
    outputs = llm.generate([REGEXES[name][1] for name, _ in cases],
                           [sampled(seed, StructuredOutput(regex=REGEXES[name][0]), 40)
                            for name, seed in cases])
    for (name, seed), output in zip(cases, outputs, strict=True):
        assert output.finish_reason == "stop", (name, seed, output.text)
        assert re.fullmatch(REGEXES[name][0], output.text), (name, seed, output.text)
    assert len({o.text for o in outputs}) > len(REGEXES), "temperature 1 should vary the outputs"


CHOICES = ("positive", "negative", "neutral", "mixed feelings")


@pytest.mark.timeout(300)
def test_choice_outputs_are_one_of_the_choices(llm) -> None:
    """float32, temperature 1.0 x 6 seeds: every output is exactly one of the choices."""
    prompt = [{"role": "user", "content": "Is the sentiment of 'I loved this film' positive, "
                                          "negative, neutral or mixed feelings?"}]
    outputs = llm.chat([prompt] * 6, [sampled(seed, StructuredOutput(choice=CHOICES), 16)
                                      for seed in range(6)])
    for output in outputs:
        assert output.finish_reason == "stop" and output.text in CHOICES, output.text


@pytest.mark.timeout(300)
def test_json_object_output_parses_to_an_object(llm) -> None:
    """float32, greedy: json_object (any JSON object, no schema) gives a complete JSON object."""
    prompt = [{"role": "user", "content": "Give a JSON object describing a person named Ann "
                                          "who is 30 years old, with keys name and age."}]
    (output,) = llm.chat([prompt], greedy(200, StructuredOutput(json_object=True)))
    assert output.finish_reason == "stop", output.text
    assert isinstance(json.loads(output.text), dict), output.text


# A context-free grammar (parentheses) with bounded repetition, so its sentences stay short;
# GRAMMAR_REGEX is the same language, for checking.
GRAMMAR = r"""
start: expr
expr: term (OP term){0,2}
term: NUMBER | "(" inner ")"
inner: NUMBER (OP NUMBER){1,2}
OP: " + " | " - " | " * "
NUMBER: /[1-9][0-9]{0,2}/
"""
_NUMBER, _OP = r"[1-9][0-9]{0,2}", r" [-+*] "
_TERM = rf"(?:{_NUMBER}|\({_NUMBER}(?:{_OP}{_NUMBER}){{1,2}}\))"
GRAMMAR_REGEX = rf"{_TERM}(?:{_OP}{_TERM}){{0,2}}"


@pytest.mark.timeout(300)
def test_lark_grammar_outputs_are_sentences_of_the_grammar(llm) -> None:
    """float32, temperature 1.0 x 3 seeds: every output is a sentence of a small Lark grammar
    and evaluates as Python arithmetic (balanced parentheses)."""
    for sentence in ("12", "(1 + 2) * 3", "4 - (5 * 67 + 8) + 9"):
        assert re.fullmatch(GRAMMAR_REGEX, sentence)
    outputs = llm.generate(["Write an arithmetic expression: "] * len(SEEDS),
                           [sampled(seed, StructuredOutput(grammar=GRAMMAR), 96) for seed in SEEDS])
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        assert re.fullmatch(GRAMMAR_REGEX, output.text), output.text
        eval(output.text, {"__builtins__": {}})     # noqa: S307 -- digits, operators, parentheses


@pytest.mark.timeout(300)
def test_greedy_is_unchanged_where_the_constraint_allows_the_free_output(llm) -> None:
    """float32, greedy: a choice list holding the unconstrained greedy text (cut at 6 tokens)
    gives the same tokens, then ends with "stop" since the choice is complete; so does a regex
    that matches exactly that text."""
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    (free,) = llm.chat([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert free.finish_reason == "length" and free.text.strip()
    for structured in (StructuredOutput(choice=(free.text, "I do not know")),
                       StructuredOutput(regex=re.escape(free.text) + "|I do not know")):
        (constrained,) = llm.chat([prompt], greedy(16, structured))
        assert constrained.text == free.text, structured
        assert constrained.token_ids[:len(free.token_ids)] == free.token_ids
        assert constrained.finish_reason == "stop"


PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Shopping list:\n1. Eggs\n2."]


@pytest.mark.timeout(300)
def test_constrained_requests_do_not_disturb_the_batch(llm) -> None:
    """float32, greedy: unconstrained requests batched with constrained ones (a schema and a
    regex at temperature 1.0, a greedy choice) give exactly what they give alone, and the
    greedy constrained one what it gives alone."""
    free_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PLAIN_PROMPTS, free_params)
    choice = greedy(8, StructuredOutput(choice=("yes", "no", "maybe")))
    (choice_alone,) = llm.generate(["Is water wet? Answer: "], choice)
    schema = SCHEMAS[7]
    prompts = [PLAIN_PROMPTS[0], json.dumps(schema) + "\nJSON: ", PLAIN_PROMPTS[1],
               "Today's date is ", "Is water wet? Answer: ", PLAIN_PROMPTS[2]]
    params = [free_params, sampled(5, StructuredOutput(json=schema), MAX_JSON_TOKENS), free_params,
              sampled(6, StructuredOutput(regex=REGEXES["date"][0]), 20), choice, free_params]
    mixed = llm.generate(prompts, params)
    assert [mixed[i].token_ids for i in (0, 2, 5)] == [o.token_ids for o in alone]
    assert mixed[4].text == choice_alone.text and mixed[4].text in ("yes", "no", "maybe")
    assert_valid_json(mixed[1], schema)
    assert re.fullmatch(REGEXES["date"][0], mixed[3].text), mixed[3].text


BAD_CONSTRAINTS = [
    pytest.param(lambda: StructuredOutput(json={"type": "nonsense"}), "json|schema", id="schema"),
    pytest.param(lambda: StructuredOutput(json="{not json"), "json|schema", id="schema-text"),
    pytest.param(lambda: StructuredOutput(regex="(unclosed"), "regex", id="regex"),
    pytest.param(lambda: StructuredOutput(grammar="start: undefined_rule"), "grammar", id="grammar"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("make", "field"), BAD_CONSTRAINTS)
def test_a_constraint_that_cannot_compile_is_refused_by_name(llm, make, field) -> None:
    """float32: an invalid schema, a regex or grammar that cannot compile raises (ValueError or
    EngineError) naming the field, alone or among good requests; the engine is left idle and
    still answers a plain request."""
    with pytest.raises((ValueError, EngineError), match=rf"(?i){field}"):
        llm.generate(["Hello"], greedy(8, make()))
    with pytest.raises((ValueError, EngineError), match=rf"(?i){field}"):
        llm.generate(["Hello", "Hi there"], [greedy(8), greedy(8, make())])
    assert_idle(llm)
    (plain,) = llm.generate(["The capital of France is"], greedy(4))
    assert plain.finish_reason == "length" and len(plain.token_ids) == 4


@pytest.mark.timeout(300)
def test_samples_logprobs_stop_strings_and_penalties_still_validate(llm) -> None:
    """float32, temperature 1.0: four samples of one prompt (n=4 by seeds), with logprobs=3,
    an unreachable stop string and all three penalties, all validate; their logprobs are one
    record per generated token. A stop string the constraint does reach ends the text before
    it (finish_reason "stop"), leaving a prefix of a choice."""
    schema = {"type": "object", "additionalProperties": False, "required": ["level", "tags", "ok"],
              "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"type": "string", "enum": ["red", "blue", "green"]}},
                             "ok": {"type": "boolean"}}}
    params = [sampled(seed, StructuredOutput(json=schema), 120, logprobs=3, stop=("@@",),
                      repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
              for seed in range(4)]
    outputs = llm.chat([json_prompt(schema)] * 4, params)
    for output in outputs:
        assert_valid_json(output, schema)
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        assert [r.token_id for r in output.logprobs] == output.token_ids
        assert all(len(r.top) == 3 for r in output.logprobs)
    choices = ("red;1", "blue;2")
    stopped = llm.generate(["Pick a colour: "] * 3, [
        sampled(seed, StructuredOutput(choice=choices), 16, stop=(";",), frequency_penalty=1.0)
        for seed in range(3)])
    for output in stopped:
        assert output.finish_reason == "stop" and output.text in ("red", "blue"), output.text
