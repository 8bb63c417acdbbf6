"""The FastAPI application of the HTTP front: OpenAI completions and chat, health, metrics, admin.

Every engine call goes through one AsyncClient; the scheduler never sees HTTP.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, FastAPI, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.curve import rpc_server_key
from spmd_runtime.protocol.messages import ModelInfo
from spmd_runtime.protocol.sampling import SamplingParams, StructuredOutput
from spmd_runtime.runtime.async_client import AsyncClient
from spmd_runtime.runtime.client import EngineError
from spmd_runtime.runtime.serving.choice import ChoiceRun
from spmd_runtime.runtime.serving.errors import APIError, api_error_handler, validation_error_handler
from spmd_runtime.runtime.serving.logprobs import LogprobFormat
from spmd_runtime.runtime.serving.metrics import ServingMetrics
from spmd_runtime.runtime.serving.responses import (
    ChoiceStreamResponse,
    ResponseShape,
    close_all,
    complete,
    stream_events,
)
from spmd_runtime.runtime.serving.schema import (
    AdminBatchBody,
    ChatCompletionBody,
    CompletionBody,
    GenerationBody,
    chat_messages,
    check_supported,
    choice_count,
    sampling_params,
    with_sampled_logprobs,
)
from spmd_runtime.runtime.serving.structured import request_constraint
from spmd_runtime.runtime.serving.tools import ToolMode, tool_request
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
                             admin_token=config.admin_token, auth_token=config.auth_token,
                             server_key=rpc_server_key(config))
        try:
            info = await client.wait_ready()
            tokenizer = await asyncio.to_thread(_load_tokenizer, info.model)
            metrics = ServingMetrics(info.served_model_name or info.model)
            app.state.serving = ServingState(config, client, info, tokenizer, metrics,
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
        "owned_by": "spmd-runtime", "root": state.info.model, "parent": None,
        "max_model_len": state.info.max_model_len,
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
    if not (state.config.enable_admin and expected):
        raise APIError("admin calls are disabled on this server: start it with --enable-admin "
                       "--admin-token SECRET",
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
    tools, tool_mode, forced = tool_request(body, state.config.tool_call_parser)
    if state.tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot chat; use /v1/completions "
                       "with token-id prompts", param="messages")
    try:
        prompt = chat_prompt_ids(state.tokenizer, messages, tools)
    except Exception as error:   # template errors (jinja) say what is wrong with the messages
        raise APIError(f"cannot apply the chat template: {error}", param="messages") from None
    return await _generate(request, state, body, [prompt], chat=True, tools=(tool_mode, forced))


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
                    prompts: list[list[int]], chat: bool,
                    tools: tuple[ToolMode | None, StructuredOutput | None] = (None, None)
                    ) -> Response:
    started = time.perf_counter()
    if body.model is not None and body.model != state.model_name:
        raise APIError(f"The model {body.model!r} does not exist: this server serves "
                       f"{state.model_name!r}", status=404, param="model", code="model_not_found")
    check_supported(body)
    n, candidates = choice_count(body)
    default_max_tokens = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    tool_mode, forced = tools
    constraint = request_constraint(body, forced)      # compiled once, not once per choice
    plans = [[sampling_params(body, len(prompt), state.info.max_model_len, default_max_tokens, k,
                              constraint) for k in range(candidates)] for prompt in prompts]
    logprobs = LogprobFormat(state.tokenizer, chat) if plans[0][0].logprobs is not None else None
    if candidates > n:     # ranked by the sampled tokens' logprobs, whether asked for or not
        plans = [[with_sampled_logprobs(params) for params in plan] for plan in plans]
    runs: list[ChoiceRun] = []
    try:
        for prompt, choices in zip(prompts, plans, strict=True):
            await _submit_choices(state, body, prompt, choices, started, runs)
    except ValueError as error:
        close_all(runs)
        raise APIError(str(error), param="prompt" if not chat else "messages") from None
    except EngineError as error:
        close_all(runs)
        raise APIError(str(error), status=503, type="server_error") from None
    except BaseException:
        close_all(runs)
        raise
    response = ResponseShape(chat, state.model_name, sum(map(len, prompts)), logprobs, tool_mode)
    if body.stream:
        return ChoiceStreamResponse(runs, stream_events(runs, response, body.include_usage))
    return await complete(request, runs, response, keep=(n, candidates))


async def _submit_choices(state: ServingState, body: GenerationBody, prompt: list[int],
                          choices: list[SamplingParams], started: float,
                          runs: list[ChoiceRun]) -> None:
    """Add the runs of one prompt's choices to `runs`. The first is submitted now; where the
    prompt has a full KV block to share (and prefix caching is on), the others are submitted
    once its prompt is computed, so that they reuse its blocks instead of computing them again."""
    def opener(params: SamplingParams):
        return lambda: state.client.submit(prompt, params, timeout_s=body.timeout)

    leader = ChoiceRun(len(runs), await opener(choices[0])(), state.metrics, started)
    runs.append(leader)
    shared_blocks = (len(prompt) - 1) // state.info.block_size
    share = state.config.enable_prefix_caching and shared_blocks > 0
    for params in choices[1:]:
        if share:
            runs.append(ChoiceRun(len(runs), None, state.metrics, started,
                                  open_after=(leader.prefilled, opener(params))))
        else:
            runs.append(ChoiceRun(len(runs), await opener(params)(), state.metrics, started))


def serve_forever(config: EngineConfig, listener) -> None:
    """Run the front on `listener`, a socket bound to http_host:http_port, until stopped."""
    import uvicorn
    uvicorn.Server(uvicorn.Config(build_app(config), log_config=None, log_level=config.log_level.lower(),
                   access_log=config.log_level.lower() == "debug", timeout_graceful_shutdown=2)
                   ).run(sockets=[listener])
