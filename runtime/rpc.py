"""What both RPC clients share: the address check and connection, one AddRequest per prompt
(texts and conversations are tokenized by the engine), and the EngineError they raise."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import zmq
from spmd_runtime.protocol.messages import AddRequest, ChatMessage
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.transport import make_socket

# A text, token ids, or (chat prompts only) a conversation of {'role', 'content'} messages.
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]

RPC_SCHEMES = ("tcp://", "ipc://", "inproc://")


class EngineError(RuntimeError):
    """The engine failed or stopped answering.

    `kind` says how: "unreachable" (nothing answered within the client's timeout),
    "not_ready" (it answered, but its workers were not ready in time), "exited" (its process is
    gone), "failed" (it failed a request), "closed" (the client was closed). `address` is the
    engine's RPC address; `__cause__` holds the underlying error where there is one."""

    def __init__(self, message: str, *, kind: str = "failed", address: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.address = address


def check_rpc_address(address: str) -> None:
    """ValueError unless `address` is an RPC address a client can connect to."""
    if not isinstance(address, str) or not address.startswith(RPC_SCHEMES):
        scheme = address.partition("://")[0] if isinstance(address, str) else ""
        if scheme.lower() in ("http", "https"):
            raise ValueError(
                f"{address} is an HTTP address: the HTTP front takes OpenAI clients (or plain "
                "HTTP); Client and AsyncClient need the engine's RPC address, tcp://host:port "
                "(spmdrun serve --rpc-address) or ipc://path")
        raise ValueError(f"{address!r} is not an RPC address: Client and AsyncClient need "
                         "tcp://host:port (spmdrun serve --rpc-address) or ipc://path")


def connect(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A DEALER socket connected to the engine at `address` (checked first)."""
    check_rpc_address(address)
    try:
        return make_socket(ctx, zmq.DEALER, address, bind=False)
    except zmq.ZMQError as error:
        raise ValueError(f"cannot connect to {address}: {error}") from error


def add_request(tag: int, prompt: Prompt, params: SamplingParams, *, chat: bool = False,
                request_id: int | None = None, priority: int = 0,
                timeout_s: float | None = None, detokenize: bool = True) -> AddRequest:
    """The AddRequest of one prompt. Texts and conversations are tokenized by the engine; with
    chat, a text is one user message, rendered (like a conversation) with its chat template."""
    fields = {"tag": tag, "params": params, "request_id": request_id, "priority": priority,
              "timeout_s": timeout_s, "detokenize": detokenize}
    if isinstance(prompt, str):
        if chat:
            return AddRequest(messages=[ChatMessage("user", prompt)], **fields)
        return AddRequest(prompt=prompt, **fields)
    if _is_conversation(prompt):
        if not chat:
            raise ValueError("a conversation (a list of {'role', 'content'} messages) is a chat "
                             "prompt: use chat()")
        return AddRequest(messages=[_chat_message(m) for m in prompt], **fields)
    if chat:
        raise ValueError("a chat prompt is a text or a conversation, not token ids")
    try:
        token_ids = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ValueError(f"a prompt is a text or a list of token ids, got {prompt!r:.80}") from None
    return AddRequest(prompt_token_ids=token_ids, **fields)



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


def as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or _is_token_list(prompts) or _is_conversation(prompts):
        return [prompts]
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("no prompts given")
    return prompt_list


def as_param_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    param_list = list(params)
    if len(param_list) != count:
        raise ValueError(f"got {len(param_list)} SamplingParams for {count} prompts")
    return param_list
