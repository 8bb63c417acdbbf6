"""How the HTTP front answers: the JSON of a completion or chat completion, whole or as
server-sent events, with every choice aborted when the client goes away."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from spmd_runtime.runtime.client import EngineError
from spmd_runtime.runtime.serving.choice import ChoiceRun
from spmd_runtime.runtime.serving.errors import APIError
from spmd_runtime.runtime.serving.logprobs import LogprobFormat
from spmd_runtime.runtime.serving.tool_calls import Delta, tool_call_json
from spmd_runtime.runtime.serving.tools import ToolMode

log = logging.getLogger("spmd.http")


def close_all(runs: list[ChoiceRun]) -> None:
    for run in runs:
        run.close()


class ChoiceStreamResponse(StreamingResponse):
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
            close_all(self.runs)


class ResponseShape:
    """The JSON of a completion or chat completion, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int,
                 logprobs: LogprobFormat | None = None, tools: ToolMode | None = None) -> None:
        self.chat = chat
        self.tools = tools              # None: replies are plain content
        self.logprobs = logprobs        # None: the request asked for none
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

    def choice_logprobs(self, run: ChoiceRun, records: list) -> dict | None:
        """The `logprobs` object of these next tokens of the run (None when not asked)."""
        if self.logprobs is None:
            return None
        shaped, run.text_offset = self.logprobs.choice(records, run.text_offset)
        return shaped

    def whole(self, runs: list[ChoiceRun], texts: list[str],
              generated: list[ChoiceRun] | None = None) -> dict:
        """The response of these choices; usage counts the tokens of `generated` (default: the
        choices), which best_of makes more than the choices returned."""
        if self.chat:
            choices = [{"index": run.index, **self._message(run, text),
                        "logprobs": self.choice_logprobs(run, run.logprobs)}
                       for run, text in zip(runs, texts, strict=True)]
            body = self._envelope("chat.completion", choices)
        else:
            choices = [{"index": run.index, "text": text,
                        "logprobs": self.choice_logprobs(run, run.logprobs),
                        "finish_reason": run.finish_reason}
                       for run, text in zip(runs, texts, strict=True)]
            body = self._envelope("text_completion", choices)
        body["usage"] = self.usage(runs if generated is None else generated)
        return body

    def _message(self, run: ChoiceRun, text: str) -> dict:
        """A chat choice's message and finish reason: with tools, its calls read out of it."""
        if self.tools is None:
            return {"message": {"role": "assistant", "content": text},
                    "finish_reason": run.finish_reason}
        content, calls = self.tools.parse(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = tool_call_json(calls)
        return {"message": message, "finish_reason": _with_calls(run.finish_reason, bool(calls))}

    def tool_chunks(self, run: ChoiceRun, deltas: list[Delta], logprobs: dict | None = None
                    ) -> list[dict]:
        """Stream chunks of a choice's tool-call deltas (content ones included)."""
        chunks = [self._envelope("chat.completion.chunk", [{
            "index": run.index, "delta": delta.to_openai(), "logprobs": None,
            "finish_reason": None}]) for delta in deltas]
        if logprobs is not None:
            chunks.append(self.chunk(run.index, None, None, logprobs=logprobs))
        return chunks

    def chunk(self, index: int, text: str | None, finish_reason: str | None,
              role: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, runs: list[ChoiceRun]) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(runs)
        return body


async def complete(request: Request, runs: list[ChoiceRun], shape: ResponseShape,
                   keep: tuple[int, int] = (1, 1)) -> Response:
    """The whole response once every choice finished. keep = (n, candidates per prompt): with
    more candidates than n, each prompt's n with the highest cumulative logprob (best_of)."""
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
        close_all(runs)
    kept, kept_texts = best_of(runs, texts, *keep) if keep[1] > keep[0] else (runs, texts)
    return JSONResponse(shape.whole(kept, kept_texts, generated=runs))


def cumulative_logprob(run: ChoiceRun) -> float:
    return sum(record.logprob for record in run.logprobs)


def best_of(runs: list[ChoiceRun], texts: list[str], n: int, candidates: int
            ) -> tuple[list[ChoiceRun], list[str]]:
    """Of each prompt's consecutive `candidates` runs, the n with the highest cumulative logprob
    of their sampled tokens (in candidate order on ties), renumbered as choices 0, 1, ..."""
    kept: list[tuple[ChoiceRun, str]] = []
    for first in range(0, len(runs), candidates):
        group = list(zip(runs[first:first + candidates], texts[first:first + candidates],
                         strict=True))
        kept += sorted(group, key=lambda pair: -cumulative_logprob(pair[0]))[:n]
    for index, (run, _) in enumerate(kept):
        run.index = index
    return [run for run, _ in kept], [text for _, text in kept]


async def _cancel_on_disconnect(request: Request, tasks: list[asyncio.Task]) -> None:
    """When the client hangs up, cancel its choices (which aborts their engine requests).

    Only for whole responses: while a StreamingResponse streams, Starlette itself listens for
    the disconnect and cancels the stream (see ChoiceStreamResponse).
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass
    log.info("client disconnected: aborting %d request(s)", len(tasks))
    for task in tasks:
        task.cancel()


def _with_calls(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of a reply that made tool calls: tool_calls where it stopped."""
    return "tool_calls" if called and reason == "stop" else reason


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream_events(runs: list[ChoiceRun], shape: ResponseShape,
                         include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: chunks of every choice as they come, usage if asked, then [DONE]."""
    queue: asyncio.Queue[tuple[ChoiceRun, tuple | None | EngineError]] = asyncio.Queue()

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
        calls = {run.index: shape.tools.stream() for run in runs} if shape.tools else {}
        remaining = len(runs)
        while remaining:
            run, item = await queue.get()
            if isinstance(item, EngineError):
                yield _sse(APIError(str(item), status=500, type="server_error").body())
                break
            stream = calls.get(run.index)
            if item is None:
                remaining -= 1
                reason = run.finish_reason
                if stream is not None:
                    for chunk in shape.tool_chunks(run, stream.finish()):
                        yield _sse(chunk)
                    reason = _with_calls(reason, stream.called)
                yield _sse(shape.chunk(run.index, None, reason))
                continue
            text, records = item
            logprobs = shape.choice_logprobs(run, records)
            if stream is not None:
                for chunk in shape.tool_chunks(run, stream.feed(text), logprobs):
                    yield _sse(chunk)
            else:
                yield _sse(shape.chunk(run.index, text, None, logprobs=logprobs))
        else:
            if include_usage:
                yield _sse(shape.usage_chunk(runs))
        yield _sse("[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        close_all(runs)
