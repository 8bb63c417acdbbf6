"""OpenAI request bodies, and their translation into engine SamplingParams with errors that say
what to change."""
from __future__ import annotations

import json
from typing import Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field
from spmd_runtime.protocol.config_fields import VictimPolicy
from spmd_runtime.protocol.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput
from spmd_runtime.runtime.serving.errors import APIError

# Fields of the OpenAI API (and of vLLM's extensions) this server does not implement, with the
# values that mean "off": a request may carry them (SDKs and tools send some by default) as long
# as it asks for nothing else. Any other field the server does not know is refused too, so no
# request is silently served differently from what it asked.
UNSUPPORTED_FIELDS = {
    "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "parallel_tool_calls": (None, False, True),
    "store": (None, False), "metadata": (None, {}),
    "min_tokens": (None, 0),
}
SAMPLING_EXTRAS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
MAX_STOP_STRINGS = 4
MAX_CHOICES = 64


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationBody(BaseModel):
    """What completions and chat completions share."""

    # Unknown fields are kept (not rejected) so that UNSUPPORTED_FIELDS can be checked.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions beyond the OpenAI API.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    # Seconds the request may run; then it ends with finish_reason "timeout".
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Structured outputs (runtime/serving/structured.py): OpenAI's, then vLLM's spellings.
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(GenerationBody):
    # Text, token ids, or a list of either (one choice group per prompt).
    prompt: str | list[int] | list[str] | list[list[int]]
    # Candidates per prompt of which the n best are returned; only n itself for now.
    best_of: int | None = None
    # The top-k per generated token (bool: what some clients send for "off").
    logprobs: int | bool | None = None


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and the call a tool turn answers.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Tool calling (runtime/serving/tools.py).
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class AdminBatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int | None = Field(default=None, ge=1, lt=2**31)
    force_evict: int | None = Field(default=None, ge=0, lt=2**31)
    target_temp_c: float | None = Field(default=None, allow_inf_nan=False)
    policy: VictimPolicy | None = None
    dry_run: bool = False


def check_supported(body: GenerationBody) -> None:
    """Refuse, naming it, every field this server would otherwise ignore."""
    for name, value in (body.model_extra or {}).items():
        if name not in UNSUPPORTED_FIELDS:
            raise APIError(f"{name} is not a field this server knows; remove it from the request",
                           param=name, code="unsupported_parameter")
        if value not in UNSUPPORTED_FIELDS[name]:
            raise APIError(f"{name} is not supported by this server; remove it from the request",
                           param=name, code="unsupported_parameter")


def stop_strings(body: GenerationBody) -> tuple[str, ...]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}",
                       param="stop")
    if any(not s for s in stops):
        raise APIError("stop strings must not be empty", param="stop")
    return tuple(stops)


def chat_messages(body: ChatCompletionBody) -> list[dict]:
    """Messages as the chat template takes them: plain-text content only."""
    if not body.messages:
        raise APIError("messages must hold at least one message", param="messages")
    messages = []
    for index, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(f"messages.{index}.content: only text parts are supported, "
                                   f"got a part of type {part.type!r}",
                                   param=f"messages.{index}.content")
            content = "".join(part.text for part in content)
        turn = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            turn["tool_calls"] = [_template_call(index, call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        if message.name is not None and message.role == "tool":
            turn["name"] = message.name
        messages.append(turn)
    return messages


def _template_call(index: int, call: dict) -> dict:
    """An assistant turn's tool call as chat templates take it: arguments as an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(f"messages.{index}.tool_calls: each call needs function.name",
                       param=f"messages.{index}.tool_calls")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise APIError(f"messages.{index}.tool_calls: arguments must be JSON",
                       param=f"messages.{index}.tool_calls") from None
    return {**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def requested_max_tokens(body: GenerationBody) -> int | None:
    if isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def sampling_params(body: GenerationBody, prompt_len: int, max_model_len: int,
                    default_max_tokens: int | None, choice: int,
                    constraint: StructuredOutput | None = None) -> SamplingParams:
    """Engine parameters of one choice, under `constraint` (structured.request_constraint).
    Without max_tokens, a completion gets default_max_tokens (None: the rest of the context)
    cut to what the context leaves."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens, and your "
                       f"prompt has {prompt_len} tokens, which leaves no room for a completion; "
                       "shorten the prompt", param="prompt" if isinstance(body, CompletionBody)
                       else "messages", code="context_length_exceeded")
    max_tokens = requested_max_tokens(body)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    elif prompt_len + max_tokens > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens, but you "
                       f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                       f"{max_tokens} for the completion); shorten the prompt or lower max_tokens "
                       f"to at most {room}", param="max_tokens", code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0 <= temperature <= 2:
        raise APIError(f"temperature must be between 0 and 2, got {temperature}",
                       param="temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise APIError(f"top_p must be greater than 0 and at most 1, got {top_p}", param="top_p")
    top_k = -1 if body.top_k is None else body.top_k
    if top_k != -1 and top_k < 1:
        raise APIError(f"top_k must be -1 (off) or at least 1, got {top_k}", param="top_k")
    # Choices of one request differ yet stay reproducible: choice i samples with seed + i.
    seed = None if body.seed is None else body.seed + choice
    stops = stop_strings(body)
    # Left out when not sent, so that SamplingParams' neutral defaults apply.
    extras = {name: getattr(body, name) for name in SAMPLING_EXTRAS
              if getattr(body, name) is not None}
    logprobs = logprob_count(body)
    if logprobs is not None:
        extras["logprobs"] = logprobs
    if constraint is not None:
        extras["structured_output"] = constraint
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=seed, ignore_eos=body.ignore_eos,
                              stop=stops, stop_token_ids=tuple(body.stop_token_ids or ()),
                              **extras)
    except ValueError as error:           # out of range, or past what the wire carries
        field = next((name for name in (*SAMPLING_EXTRAS, "stop_token_ids")
                      if name in str(error)), None)
        raise APIError(str(error), param=field) from None


def with_sampled_logprobs(params: SamplingParams) -> SamplingParams:
    """params with the sampled tokens' logprobs asked for (best_of ranks candidates by them)."""
    return params if params.logprobs is not None else msgspec.structs.replace(params, logprobs=0)


def choice_count(body: GenerationBody) -> tuple[int, int]:
    """(n, the candidates to run per prompt): best_of candidates of which the n with the
    highest cumulative logprob are returned, or n when best_of is not above it."""
    if not 1 <= body.n <= MAX_CHOICES:
        raise APIError(f"n must be between 1 and {MAX_CHOICES}, got {body.n}", param="n")
    best_of = getattr(body, "best_of", None)
    if best_of is None or best_of == body.n:
        return body.n, body.n
    if best_of < body.n:
        raise APIError(f"best_of must be at least n ({body.n}), got {best_of}", param="best_of")
    if best_of > MAX_CHOICES:
        raise APIError(f"best_of must be at most {MAX_CHOICES}, got {best_of}", param="best_of")
    if body.stream:
        raise APIError("best_of greater than n cannot be streamed: the best candidates are known "
                       "only when all have finished; set stream to false", param="best_of")
    return body.n, best_of


def logprob_count(body: GenerationBody) -> int | None:
    """The engine's SamplingParams.logprobs: completions' `logprobs` (the top-k), chat's
    `top_logprobs` when `logprobs` is true; None when not asked."""
    if isinstance(body, ChatCompletionBody):
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}",
                           param="top_logprobs")
        if not body.logprobs:
            if top:
                raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
            return None
        return top or 0
    value = getattr(body, "logprobs", None)
    if value is None or value is False:
        return None
    if value is True or not 0 <= value <= MAX_LOGPROBS:
        raise APIError(f"logprobs must be an integer between 0 and {MAX_LOGPROBS}, got "
                       f"{str(value).lower()}", param="logprobs")
    return value
