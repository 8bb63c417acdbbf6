"""`spmdrun bench serving`: online load (Poisson arrivals, or all at once) against the HTTP front or
the RPC endpoint, reporting throughput and per-token latencies.

Each request is a prompt of random token ids (or a shared prefix plus its own suffix), greedy,
with a fixed output length (EOS ignored), streamed so that every token's arrival is timed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from spmd_runtime.launch.progress import Progress
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.async_client import AsyncClient


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    # Gaps between consecutive output chunks, spread over the tokens each chunk carried.
    token_gaps_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


Sender = Callable[[list[int]], Awaitable[RequestResult]]


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `request_rate` requests per
    second, or all at time 0 when the rate is infinite."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def run_load(send: Sender, prompts: list[list[int]], request_rate: float,
                   max_concurrency: int, seed: int) -> tuple[list[RequestResult], float]:
    """Send every prompt at its arrival time (at most max_concurrency in flight; 0: no limit);
    returns the results in prompt order and the wall time from first send to last answer."""
    offsets = arrival_offsets(len(prompts), request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    started = time.perf_counter()

    with Progress(len(prompts), "bench serving") as progress:
        async def one(prompt: list[int], offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            if limit is None:
                result = await send(prompt)
            else:
                async with limit:
                    result = await send(prompt)
            progress.update()
            return result

        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets, strict=True)))
    return list(results), time.perf_counter() - started


# ---------------------------------------------------------------------------- senders

def rpc_sender(client: AsyncClient, output_len: int) -> Sender:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def send(prompt: list[int]) -> RequestResult:
        result = RequestResult(len(prompt))
        started = last = time.perf_counter()
        try:
            async for delta in await client.submit(prompt, params):
                now = time.perf_counter()
                if delta.token_ids:
                    _record(result, len(delta.token_ids), now - started, now - last)
                    last = now
        except Exception as error:   # counted as a failed request, whatever went wrong
            result.error = repr(error)
        result.latency_s = time.perf_counter() - started
        return result

    return send


def http_sender(http, base_url: str, model: str, output_len: int) -> Sender:
    """Streams /v1/completions with token-id prompts. Output tokens are counted from usage;
    inter-token gaps are those between text chunks (one token each, except where a chunk
    completes a character that several tokens spell)."""
    payload = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}

    async def send(prompt: list[int]) -> RequestResult:
        result = RequestResult(len(prompt))
        started = last = time.perf_counter()
        try:
            async with http.stream("POST", f"{base_url}/v1/completions",
                                   json={**payload, "prompt": prompt}) as response:
                if response.status_code != 200:
                    body = await response.aread()
                    raise RuntimeError(f"HTTP {response.status_code}: {body.decode()[:200]}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    now = time.perf_counter()
                    if any(c.get("text") for c in chunk["choices"]):
                        _record(result, 0, now - started, now - last)
                        last = now
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
        except Exception as error:
            result.error = repr(error)
        result.latency_s = time.perf_counter() - started
        return result

    return send


def _record(result: RequestResult, tokens: int, since_start_s: float, gap_s: float) -> None:
    if not result.ttft_s:
        result.ttft_s = since_start_s
    elif tokens:
        result.token_gaps_s.extend([gap_s / tokens] * tokens)
    else:
        result.token_gaps_s.append(gap_s)
    result.output_tokens += tokens


# ---------------------------------------------------------------------------- report

@dataclass
class ServingReport:
    endpoint: str
    request_rate: float
    results: list[RequestResult]
    duration_s: float

    @property
    def succeeded(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def summary(self) -> dict:
        ok = self.succeeded
        input_tokens = sum(r.prompt_tokens for r in ok)
        output_tokens = sum(r.output_tokens for r in ok)
        return {
            "successful_requests": len(ok), "failed_requests": len(self.results) - len(ok),
            "duration_s": self.duration_s, "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "request_throughput": len(ok) / self.duration_s,
            "output_token_throughput": output_tokens / self.duration_s,
            "total_token_throughput": (input_tokens + output_tokens) / self.duration_s,
            "ttft_ms": _spread([r.ttft_s for r in ok]),
            "tpot_ms": _spread([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl_ms": _spread([g for r in ok for g in r.token_gaps_s]),
        }

    def table(self) -> str:
        s = self.summary()
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g} req/s"
        rows = [
            f"serving benchmark: {self.endpoint}, arrivals {rate}",
            f"{'successful requests':<34}{s['successful_requests']:>12}",
            f"{'failed requests':<34}{s['failed_requests']:>12}",
            f"{'duration (s)':<34}{s['duration_s']:>12.2f}",
            f"{'input tokens':<34}{s['input_tokens']:>12}",
            f"{'output tokens':<34}{s['output_tokens']:>12}",
            f"{'request throughput (req/s)':<34}{s['request_throughput']:>12.2f}",
            f"{'output token throughput (tok/s)':<34}{s['output_token_throughput']:>12.1f}",
            f"{'total token throughput (tok/s)':<34}{s['total_token_throughput']:>12.1f}",
            f"{'latency (ms)':<34}{'mean':>12}{'median':>12}{'p99':>12}",
        ]
        for key, label in (("ttft_ms", "time to first token"),
                           ("tpot_ms", "time per output token"),
                           ("itl_ms", "inter-token latency")):
            mean, median, p99 = s[key]
            rows.append(f"{label:<34}{mean:>12.1f}{median:>12.1f}{p99:>12.1f}")
        failures = [r.error for r in self.results if not r.ok]
        if failures:
            rows.append(f"first failure: {failures[0]}")
        return "\n".join(rows)


def _spread(seconds: list[float]) -> tuple[float, float, float]:
    """(mean, median, 99th percentile) in milliseconds; zeros without samples."""
    if not seconds:
        return (0.0, 0.0, 0.0)
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return (1000 * statistics.fmean(ordered), 1000 * statistics.median(ordered), 1000 * p99)


# ---------------------------------------------------------------------------- entry

async def measure(endpoint: str, url: str, model: str, prompts: list[list[int]], output_len: int,
                  request_rate: float, max_concurrency: int, seed: int,
                  alive: Callable[[], bool] | None = None, auth_token: str = "") -> ServingReport:
    """One warm-up request, then the timed load against `url` (http://... or an RPC address;
    auth_token is the server's --auth-token, if it has one: sent on every RPC frame, or as the
    HTTP API key)."""
    warmup = [3] * 8   # no workload prompt starts like this: it seeds no prefix-cache hit
    if endpoint == "http":
        import httpx
        logging.getLogger("httpx").setLevel(logging.WARNING)   # not one line per request
        timeout = httpx.Timeout(600.0, connect=30.0)
        limits = httpx.Limits(max_connections=max(len(prompts), 1) + 1, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits,
                                     headers=api_key_header(auth_token)) as http:
            send = http_sender(http, url, model, output_len)
            _check_warmup(await http_sender(http, url, model, 2)(warmup))
            results, duration = await run_load(send, prompts, request_rate, max_concurrency, seed)
        return ServingReport(f"{url}/v1/completions", request_rate, results, duration)
    async with AsyncClient(url, alive=alive, auth_token=auth_token) as client:
        await client.wait_ready()
        _check_warmup(await rpc_sender(client, 2)(warmup))
        results, duration = await run_load(rpc_sender(client, output_len), prompts,
                                           request_rate, max_concurrency, seed)
    return ServingReport(f"RPC {url}", request_rate, results, duration)


async def served_model(url: str, auth_token: str = "") -> tuple[str, int]:
    """(model name, vocabulary size) of the server at an http:// URL or an RPC address."""
    if url.startswith(("http://", "https://")):
        import httpx
        try:
            async with httpx.AsyncClient(timeout=30.0, headers=api_key_header(auth_token)) as http:
                reply = await http.get(f"{url.rstrip('/')}/v1/models")
                reply.raise_for_status()
                card = reply.json()["data"][0]
        except httpx.HTTPError as error:
            raise RuntimeError(f"cannot list the models of {url}: {error}") from None
        return card["id"], card["vocab_size"]
    async with AsyncClient(url, timeout_s=120.0, auth_token=auth_token) as client:
        info = await client.wait_ready()
    return info.model, info.vocab_size


def api_key_header(auth_token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {auth_token}"} if auth_token else {}


def _check_warmup(result: RequestResult) -> None:
    if not result.ok:
        raise RuntimeError(f"the warm-up request failed: {result.error}")
