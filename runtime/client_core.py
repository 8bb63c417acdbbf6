"""What both RPC clients do alike, whatever their I/O: the defaults, argument checks, the request
messages, and turning the engine's replies into outputs, deltas and exceptions. `Client` blocks
on the socket and `AsyncClient` awaits; each adds only that (runtime/rpc.py is the connection)."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq
from spmd_runtime.protocol.logprobs import TokenLogprobs
from spmd_runtime.protocol.messages import (
    AddRequest,
    ChatMessage,
    ErrorReply,
    ModelInfo,
    RequestAccepted,
    RequestDelta,
)
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.rpc import EngineError, RpcCore

# A text, token ids, or (chat prompts only) a conversation of {'role', 'content'} messages.
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]

# Silence (pings unanswered) after which every outstanding call fails with EngineError. The
# engine answers pings even mid-step, so this bounds only how long a dead engine goes unnoticed.
TIMEOUT_S = 30.0
# Silence after which the client pings the engine; at most a third of timeout_s.
PING_AFTER_S = 1.0
# How long wait_ready() waits, by default, for every worker to load.
READY_TIMEOUT_S = 600.0


@dataclass
class StreamDelta:
    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # As RequestOutput's: one record per token (with SamplingParams.logprobs); the prompt's on
    # the first delta (with prompt_logprobs).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @classmethod
    def of(cls, delta: RequestDelta) -> StreamDelta:
        return cls(delta.request_id, delta.token_ids, delta.text, delta.finish_reason,
                   delta.logprobs, delta.prompt_logprobs)


class ClientCore(RpcCore):
    """The connection (RpcCore) plus everything about requests that does not wait: a face
    checks and builds its messages here, and turns what comes back into results here."""

    def __init__(self, ctx: zmq.Context, address: str, *, timeout_s: float, ping_after_s: float,
                 alive: Callable[[], bool] | None, admin_token: str, auth_token: str,
                 server_key: str | bytes, send_flags: int = 0) -> None:
        if not timeout_s > 0 or not ping_after_s > 0:
            raise ValueError(f"timeout_s and ping_after_s must be > 0 seconds, got {timeout_s} "
                             f"and {ping_after_s}")
        # Ping early enough that a busy engine answers before a short timeout runs out.
        super().__init__(ctx, address, timeout_s=timeout_s,
                         ping_after_s=min(ping_after_s, timeout_s / 3), alive=alive,
                         admin_token=admin_token, auth_token=auth_token, send_flags=send_flags,
                         server_key=server_key)
        self._model_info: ModelInfo | None = None

    def _tagged(self, message_type: type[msgspec.Struct], **fields) -> msgspec.Struct:
        """A control message with a fresh tag."""
        return message_type(tag=next(self._tags), **fields)

    def _batch_requests(self, prompts: Prompt | Sequence[Prompt],
                        params: SamplingParams | Sequence[SamplingParams] | None,
                        priority: int | Sequence[int], request_timeout_s: float | None,
                        chat: bool) -> list[AddRequest]:
        """generate()'s AddRequests, one per prompt, in order: each output in one delta when it
        ends (generate() waits for whole outputs)."""
        prompt_list = as_prompt_list(prompts)
        param_list = as_param_list(params, len(prompt_list))
        priorities = as_priority_list(priority, len(prompt_list))
        check_request_timeout(request_timeout_s)
        return [add_request(next(self._tags), prompt, p, chat=chat, priority=rank,
                            timeout_s=request_timeout_s, stream=False)
                for prompt, p, rank in zip(prompt_list, param_list, priorities, strict=True)]

    def _stream_request(self, prompt: Prompt, params: SamplingParams | None,
                        request_id: int | None, priority: int, request_timeout_s: float | None,
                        chat: bool, detokenize: bool = True) -> AddRequest:
        """The AddRequest of one streamed prompt."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        (rank,) = as_priority_list([priority], 1)
        check_request_timeout(request_timeout_s)
        return add_request(next(self._tags), prompt, params or SamplingParams(), chat=chat,
                           request_id=request_id, priority=rank, timeout_s=request_timeout_s,
                           detokenize=detokenize)

    @staticmethod
    def _accepted(reply: msgspec.Struct) -> RequestAccepted:
        """The engine's answer to an AddRequest, or ValueError with its reason for refusing."""
        if isinstance(reply, RequestAccepted):
            return reply
        raise ValueError(reply.message if isinstance(reply, ErrorReply) else
                         f"unexpected answer to a request: {reply!r:.200}")

    def _request_failed(self, reason: str) -> EngineError:
        """The error of a request the engine failed after accepting it."""
        return EngineError(reason, address=self.address)


def prompt_refused(index: int, error: Exception) -> ValueError:
    """The error of a batch whose prompt `index` was refused (the first one refused)."""
    return ValueError(f"prompt {index}: {error}")


def output_of(request: AddRequest, request_id: int,
              prompt_token_ids: list[int] | None) -> RequestOutput:
    """The output to fill for an accepted request; the prompt as the engine tokenized it (texts
    and conversations), else as sent."""
    return RequestOutput(request_id, list(prompt_token_ids or request.prompt_token_ids))


def add_request(tag: int, prompt: Prompt, params: SamplingParams, *, chat: bool = False,
                request_id: int | None = None, priority: int = 0,
                timeout_s: float | None = None, detokenize: bool = True,
                stream: bool = True) -> AddRequest:
    """The AddRequest of one prompt. Texts and conversations are tokenized by the engine; with
    chat, a text is one user message, rendered (like a conversation) with its chat template.
    stream=False: the output comes in one delta when the request ends."""
    fields = {"tag": tag, "params": params, "request_id": request_id, "priority": priority,
              "timeout_s": timeout_s, "detokenize": detokenize, "stream": stream}
    if isinstance(prompt, str):
        if chat:
            return AddRequest(messages=[ChatMessage("user", prompt)], **fields)
        return AddRequest(prompt=prompt, **fields)
    if _is_conversation(prompt):
        if not chat:
            raise ValueError("a conversation (a list of {'role', 'content'} messages) is a chat "
                             "prompt: use LLM.chat(), or chat=True with a client")
        return AddRequest(messages=[_chat_message(m) for m in prompt], **fields)
    if chat:
        raise ValueError("a chat prompt is a text or a conversation, not token ids")
    try:
        token_ids = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ValueError(f"a prompt is a text or a list of token ids, got {prompt!r:.80}") from None
    return AddRequest(prompt_token_ids=token_ids, **fields)


def as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (a text, token ids, a conversation) or several, as a list."""
    if isinstance(prompts, str) or _is_token_list(prompts) or _is_conversation(prompts):
        return [prompts]
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("no prompts given")
    return prompt_list


def as_param_list(params, count: int) -> list[SamplingParams]:
    """SamplingParams for each of `count` prompts: None (the defaults), one for all, or a list
    of one per prompt."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, Sequence) and not isinstance(params, str):
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is None:
            if len(params) != count:
                raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
            return list(params)
        got = f"a {type(params).__name__} holding a {type(bad).__name__}"
    else:
        got = type(params).__name__
    raise ValueError(f"params must be a SamplingParams, or a list of one per prompt, got {got}")


def as_priority_list(priority, count: int) -> list[int]:
    """The priority of each of `count` prompts: one for all, or a list of one per prompt."""
    many = isinstance(priority, Sequence) and not isinstance(priority, str)
    priorities = list(priority) if many else [priority] * count
    bad = next((p for p in priorities if isinstance(p, bool) or not isinstance(p, int)), None)
    if bad is not None:
        raise ValueError(f"priority must be an integer (larger is more important), or a list of "
                         f"one per prompt, got {bad!r:.80}")
    if len(priorities) != count:
        raise ValueError(f"got {len(priorities)} priorities for {count} prompts")
    return priorities


def check_request_timeout(request_timeout_s) -> None:
    """ValueError unless the request timeout is None (none) or a number of seconds > 0."""
    if request_timeout_s is None:
        return
    if isinstance(request_timeout_s, bool) or not isinstance(request_timeout_s, (int, float)) \
            or not math.isfinite(request_timeout_s) or request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s must be a number of seconds > 0, or None for no "
                         f"limit; got {request_timeout_s!r:.80}")


def _is_token_list(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) \
        and all(isinstance(t, int) for t in value)


def _is_conversation(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) \
        and all(isinstance(m, Mapping) for m in value)


def _chat_message(message: Mapping[str, str]) -> ChatMessage:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"a chat message is {{'role': str, 'content': str}}, got {message!r:.80}")
    return ChatMessage(role, content)
