"""The FastAPI application of the HTTP front: OpenAI completions and chat, health, metrics, admin.

Every engine call goes through one AsyncClient; the scheduler never sees HTTP.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, FastAPI, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.messages import ModelInfo
from spmd_runtime.runtime.async_client import AsyncClient
from spmd_runtime.runtime.client import EngineError
from spmd_runtime.runtime.serving.choice import ChoiceRun
from spmd_runtime.runtime.serving.errors import APIError, api_error_handler, validation_error_handler
from spmd_runtime.runtime.serving.metrics import ServingMetrics
from spmd_runtime.runtime.serving.schema import (
    AdminBatchBody,
    ChatCompletionBody,
    CompletionBody,
    GenerationBody,
    chat_messages,
    check_supported,
    choice_count,
    sampling_params,
    stop_strings,
)
from spmd_runtime.runtime.serving.text_stream import TextStream
from spmd_runtime.scheduler_proc.chat import chat_prompt_ids

log = logging.getLogger("spmd.http")

COMPLETION_DEFAULT_MAX_TOKENS = 16   # the OpenAI default for /v1/completions
HEALTH_TIMEOUT_S = 5.0


@dataclass
class ServingState:
    config: EngineConfig
    client: AsyncClient
    info: ModelInfo
    tokenizer: object | None         # None for a model without one: token-id prompts only
    metrics: ServingMetrics
    created: int

    @property
    def model_name(self) -> str:
        """What clients call the model (--served-model-name, else derived from --model)."""
        return self.info.served_model_name or self.info.model


def build_app(config: EngineConfig) -> FastAPI:
    """The app for an engine at config.rpc_address; it connects (and waits) at startup."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = AsyncClient(config.rpc_address, timeout_s=config.step_timeout_s,
                             admin_token=config.admin_token, auth_token=config.auth_token)
        try:
            info = await client.wait_ready()
            tokenizer = await asyncio.to_thread(_load_tokenizer, info.model)
            app.state.serving = ServingState(config, client, info, tokenizer, ServingMetrics(),
                                             int(time.time()))
            log.info("HTTP front ready on http://%s:%d for %s", config.http_host, config.http_port,
                     info.served_model_name or info.model)
            yield
        finally:
            client.close()

    app = FastAPI(title="spmd-runtime", lifespan=lifespan)
    if config.auth_token:
        _require_api_key(app, config.auth_token)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.include_router(router)
    return app


# Open without the API key: liveness probes, and admin (which takes the admin token instead).
OPEN_PATHS = frozenset({"/health", "/v1/admin/batch"})


def bearer_matches(authorization: str | None, expected: str) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              expected.encode())


def _require_api_key(app: FastAPI, auth_token: str) -> None:
    """With --auth-token, every endpoint but /health and admin wants it as the bearer token
    (the OpenAI clients' api_key)."""

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.url.path in OPEN_PATHS or bearer_matches(
                request.headers.get("authorization"), auth_token):
            return await call_next(request)
        error = APIError("missing or wrong API key: send the server's --auth-token as "
                         "'Authorization: Bearer <token>' (api_key= in OpenAI clients)",
                         status=401, type="authentication_error", code="invalid_api_key")
        return JSONResponse(error.body(), status_code=error.status)


def _load_tokenizer(model: str):
    from spmd_runtime.protocol.model_source import resolve_model
    from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer
    try:
        return load_tokenizer(resolve_model(model))
    except ValueError as error:
        log.warning("%s: only token-id prompts will be served, and outputs have no text", error)
        return None


router = APIRouter()


def _state(request: Request) -> ServingState:
    return request.app.state.serving


# ---------------------------------------------------------------------------- plain endpoints

@router.get("/health")
async def health(request: Request) -> JSONResponse:
    if await _state(request).client.ping(HEALTH_TIMEOUT_S):
        return JSONResponse({"status": "ok"})
    raise APIError(f"the engine did not answer within {HEALTH_TIMEOUT_S:.0f}s", status=503,
                   type="server_error", code="engine_unavailable")


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = _state(request)
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created,
        "owned_by": "spmd-runtime", "max_model_len": state.info.max_model_len,
        "vocab_size": state.info.vocab_size}]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    try:
        stats = await state.client.stats()
    except (EngineError, ValueError) as error:
        log.warning("/metrics without engine figures: stats failed: %s", error)
        stats = None
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/admin/batch")
async def admin_batch(request: Request, body: AdminBatchBody,
                      authorization: str | None = Header(default=None)) -> dict:
    state = _state(request)
    expected = state.config.admin_token
    if not expected:
        raise APIError("admin calls are disabled on this server: start it with --admin-token",
                       status=403, type="permission_error", code="admin_disabled")
    if not bearer_matches(authorization, expected):
        raise APIError("missing or wrong admin token: send the header 'Authorization: Bearer "
                       "<token>' with the server's --admin-token", status=401,
                       type="authentication_error", code="invalid_admin_token")
    try:
        reply = await state.client.admin_batch(token=expected, **body.model_dump())
    except PermissionError as error:
        raise APIError(str(error), status=403, type="permission_error", code="forbidden") from None
    except ValueError as error:
        raise APIError(str(error)) from None
    except EngineError as error:
        raise APIError(str(error), status=503, type="server_error") from None
    result = msgspec.structs.asdict(reply)
    result.pop("tag")
    return result


# ---------------------------------------------------------------------------- generation

@router.post("/v1/completions")
async def completions(request: Request, body: CompletionBody) -> Response:
    state = _state(request)
    prompts = _completion_prompts(state, body)
    return await _generate(request, state, body, prompts, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionBody) -> Response:
    state = _state(request)
    messages = chat_messages(body)
    if state.tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot chat; use /v1/completions "
                       "with token-id prompts", param="messages")
    try:
        prompt = chat_prompt_ids(state.tokenizer, messages)
    except Exception as error:   # template errors (jinja) say what is wrong with the messages
        raise APIError(f"cannot apply the chat template: {error}", param="messages") from None
    return await _generate(request, state, body, [prompt], chat=True)


def _completion_prompts(state: ServingState, body: CompletionBody) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    token_lists = []
    for item in prompt:
        if isinstance(item, str):
            if state.tokenizer is None:
                raise APIError("this model has no tokenizer: send the prompt as token ids",
                               param="prompt")
            item = list(state.tokenizer(item).input_ids)
        if not item:
            raise APIError("prompt must not be empty", param="prompt")
        vocab = state.info.vocab_size
        bad = next((t for t in item if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                           param="prompt")
        token_lists.append(list(item))
    return token_lists


async def _generate(request: Request, state: ServingState, body: GenerationBody,
                    prompts: list[list[int]], chat: bool) -> Response:
    started = time.perf_counter()
    if body.model is not None and body.model != state.model_name:
        raise APIError(f"The model {body.model!r} does not exist: this server serves "
                       f"{state.model_name!r}", status=404, param="model", code="model_not_found")
    check_supported(body)
    stops = stop_strings(body)
    n = choice_count(body)
    default_max_tokens = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    plans = [(prompt, sampling_params(body, len(prompt), state.info.max_model_len,
                                      default_max_tokens, k))
             for prompt in prompts for k in range(n)]
    runs: list[ChoiceRun] = []
    try:
        for index, (prompt, params) in enumerate(plans):
            # The front cuts stop strings in its own text stream, so the engine sends ids only.
            stream = await state.client.submit(prompt, params, timeout_s=body.timeout,
                                               detokenize=False)
            runs.append(ChoiceRun(index, stream, TextStream(state.tokenizer, stops),
                                  state.metrics, started))
    except ValueError as error:
        _close_all(runs)
        raise APIError(str(error), param="prompt" if not chat else "messages") from None
    except EngineError as error:
        _close_all(runs)
        raise APIError(str(error), status=503, type="server_error") from None
    except BaseException:
        _close_all(runs)
        raise
    response = _ResponseShape(chat, state.model_name, sum(map(len, prompts)))
    if body.stream:
        return _ChoiceStreamResponse(runs, _stream_events(runs, response, body.include_usage))
    return await _complete(request, runs, response)


def _close_all(runs: list[ChoiceRun]) -> None:
    for run in runs:
        run.close()


class _ChoiceStreamResponse(StreamingResponse):
    """Server-sent events that abort their choices however the response ends: a client that
    hangs up makes Starlette cancel the stream (it listens for the disconnect), possibly before
    the event generator started or while it waits at a `yield`, where its own `finally` would
    not run yet."""

    def __init__(self, runs: list[ChoiceRun], events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.runs = runs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _close_all(self.runs)


class _ResponseShape:
    """The JSON of a completion or chat completion, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self, runs: list[ChoiceRun]) -> dict:
        completion = sum(run.completion_tokens for run in runs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, runs: list[ChoiceRun], texts: list[str]) -> dict:
        if self.chat:
            choices = [{"index": run.index, "message": {"role": "assistant", "content": text},
                        "logprobs": None, "finish_reason": run.finish_reason}
                       for run, text in zip(runs, texts, strict=True)]
            body = self._envelope("chat.completion", choices)
        else:
            choices = [{"index": run.index, "text": text, "logprobs": None,
                        "finish_reason": run.finish_reason}
                       for run, text in zip(runs, texts, strict=True)]
            body = self._envelope("text_completion", choices)
        body["usage"] = self.usage(runs)
        return body

    def chunk(self, index: int, text: str | None, finish_reason: str | None,
              role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, runs: list[ChoiceRun]) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(runs)
        return body


async def _complete(request: Request, runs: list[ChoiceRun], shape: _ResponseShape) -> Response:
    tasks = [asyncio.create_task(run.collect()) for run in runs]
    watcher = asyncio.create_task(_cancel_on_disconnect(request, tasks))
    try:
        texts = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return Response(status_code=499)   # the client is gone; nobody reads this
        raise
    except EngineError as error:
        raise APIError(str(error), status=500, type="server_error") from None
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        _close_all(runs)
    return JSONResponse(shape.whole(runs, texts))


async def _cancel_on_disconnect(request: Request, tasks: list[asyncio.Task]) -> None:
    """When the client hangs up, cancel its choices (which aborts their engine requests).

    Only for whole responses: while a StreamingResponse streams, Starlette itself listens for
    the disconnect and cancels the stream (see _ChoiceStreamResponse).
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass
    log.info("client disconnected: aborting %d request(s)", len(tasks))
    for task in tasks:
        task.cancel()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream_events(runs: list[ChoiceRun], shape: _ResponseShape,
                         include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: chunks of every choice as they come, usage if asked, then [DONE]."""
    queue: asyncio.Queue[tuple[ChoiceRun, str | None | EngineError]] = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for piece in run.pieces():
                queue.put_nowait((run, piece))
            queue.put_nowait((run, None))
        except EngineError as error:
            queue.put_nowait((run, error))

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        if shape.chat:
            for run in runs:
                yield _sse(shape.chunk(run.index, None, None, role=True))
        remaining = len(runs)
        while remaining:
            run, item = await queue.get()
            if isinstance(item, EngineError):
                yield _sse(APIError(str(item), status=500, type="server_error").body())
                break
            if item is None:
                remaining -= 1
                yield _sse(shape.chunk(run.index, None, run.finish_reason))
            else:
                yield _sse(shape.chunk(run.index, item, None))
        else:
            if include_usage:
                yield _sse(shape.usage_chunk(runs))
        yield _sse("[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        _close_all(runs)


def serve_forever(config: EngineConfig, listener) -> None:
    """Run the front on `listener`, a socket bound to http_host:http_port, until stopped."""
    import uvicorn
    uvicorn.Server(uvicorn.Config(build_app(config), log_config=None, log_level=config.log_level.lower(),
                   access_log=config.log_level.lower() == "debug", timeout_graceful_shutdown=2)
                   ).run(sockets=[listener])
