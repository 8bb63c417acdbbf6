"""`spmdrun serve --http-port`: the OpenAI-compatible HTTP front, driven by the official `openai`
package and by plain HTTP.

One server per module (smollm2, --max-model-len 256, an admin token, and an RPC auth token that
the front must carry on every frame). Greedy HTTP outputs are compared with the same request
through the RPC Client of the same server.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import psutil
import pytest
from conftest import descendants, openai_client, wait_until
from prometheus_client.parser import text_string_to_metric_families
from spmd_runtime.runtime import LLM, Client, SamplingParams
from spmd_runtime.scheduler_proc.chat import chat_prompt_ids

MAX_MODEL_LEN = 256
ADMIN_TOKEN = "test-admin-secret"
AUTH_TOKEN = "test-rpc-secret"
API_KEY = {"Authorization": f"Bearer {AUTH_TOKEN}"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(spmd_serve, free_port):
    port = free_port()
    srv = spmd_serve("--model", "smollm2", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                     "--http-port", str(port), "--enable-admin", "--admin-token", ADMIN_TOKEN,
                     "--auth-token", AUTH_TOKEN)
    srv.base_url = f"http://127.0.0.1:{port}"
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def rpc(server):
    with Client(server.address, timeout_s=120, auth_token=AUTH_TOKEN) as client:
        client.wait_ready(120)
        yield client


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server, AUTH_TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120, headers=API_KEY) as client:
        yield client


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def assert_error(reply: httpx.Response, status: int, fragment: str, param: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serving(oai) -> None:
    reply = oai.completions.create(model="smollm2", prompt=[1000, 2000], max_tokens=2,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2


def wait_idle(rpc: Client):
    """Stats once nothing runs or waits (polled: aborts land within a step or two)."""
    deadline = time.monotonic() + 60
    while (stats := rpc.stats()).num_running or stats.num_waiting:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


# ---------------------------------------------------------------------------- endpoints

def test_serving_lines_health_and_models(server, oai, http) -> None:
    assert f"HTTP front on {server.base_url}" in server.stdout
    assert http.get("/health").json() == {"status": "ok"}
    (card,) = oai.models.list().data
    assert card.id == "smollm2"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_matches_the_rpc_client(oai, rpc) -> None:
    reply = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    (expected,) = rpc.generate([PROMPT], greedy(12))
    (choice,) = reply.choices
    assert choice.text == expected.text and choice.text.strip()
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(rpc.encode(PROMPT))
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + len(expected.token_ids)


def test_penalties_and_min_p_reach_the_engine(oai, rpc) -> None:
    options = {"presence_penalty": 0.5, "frequency_penalty": 1.0}
    reply = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0,
                                   extra_body={"repetition_penalty": 1.3, "min_p": 0.1}, **options)
    (expected,) = rpc.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                        repetition_penalty=1.3, min_p=0.1,
                                                        **options))
    assert reply.choices[0].text == expected.text
    assert expected.token_ids != rpc.generate([PROMPT], greedy(12))[0].token_ids


def test_streamed_completion_adds_up_to_the_same_text(oai, rpc) -> None:
    (expected,) = rpc.generate([PROMPT], greedy(12))
    chunks = list(oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 3, "tokens should arrive as they are generated"
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_matches_the_rpc_client(oai, rpc) -> None:
    prompt = chat_prompt_ids(rpc.tokenizer, MESSAGES)
    (expected,) = rpc.generate([prompt], greedy(16))
    reply = oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16,
                                        temperature=0)
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == rpc.tokenizer.decode(expected.token_ids,
                                                          skip_special_tokens=True)
    assert "Paris" in choice.message.content
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected.token_ids)

    chunks = list(oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.timeout(300)
def test_completions_and_chat_match_llm_generate(oai) -> None:
    """The same greedy requests through the in-process API, on an engine of its own."""
    with LLM("smollm2", dtype="float32", max_model_len=MAX_MODEL_LEN) as llm:
        (completion,) = llm.generate([PROMPT], greedy(12))
        (chat,) = llm.generate([chat_prompt_ids(llm.tokenizer, MESSAGES)], greedy(16))
    reply = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == completion.text
    streamed = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                      temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.text
    reply = oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16,
                                        temperature=0)
    assert reply.choices[0].message.content == chat.text


def test_raw_stream_is_server_sent_events_ending_in_done(http) -> None:
    with http.stream("POST", "/v1/completions", json={
            "model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "stream": True}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_stop_strings_cut_the_text_and_end_the_request(oai, rpc) -> None:
    prompt = "Count: 1, 2, 3,"
    (free,) = rpc.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0,
                                                    ignore_eos=True))
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    assert stop.strip(), free.text
    cut = free.text.index(stop)
    before = rpc.stats()
    reply = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0,
                                   stop=[stop, "never appears"], extra_body={"ignore_eos": True})
    (choice,) = reply.choices
    assert choice.text == free.text[:cut]
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens < 24
    streamed = list(oai.completions.create(model="smollm2", prompt=prompt, max_tokens=24,
                                           temperature=0, stop=stop, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == free.text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    after = wait_idle(rpc)
    # The engine stopped generating when the stop string appeared (the request was aborted).
    assert after.num_generated_tokens - before.num_generated_tokens < 2 * 24
    assert after.kv_blocks_in_use == 0


def test_several_choices_and_prompts(oai, rpc) -> None:
    reply = oai.completions.create(model="smollm2", prompt=[PROMPT, "Water boils at"],
                                   max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    expected = rpc.generate([PROMPT, "Water boils at"], greedy(6))
    texts = {c.index: c.text for c in reply.choices}
    assert texts[0] == texts[1] == expected[0].text
    assert texts[2] == texts[3] == expected[1].text


def test_seeded_sampling_is_reproducible(oai) -> None:
    def sample():
        reply = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10,
                                       temperature=1.0, top_p=0.9, seed=1234, n=2)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    assert sample() == sample()


# ---------------------------------------------------------------------------- errors

def test_errors_say_what_to_change(http, oai) -> None:
    def post(path: str, **body) -> httpx.Response:
        return http.post(path, json={"model": "smollm2", **body})

    error = assert_error(post("/v1/completions", prompt="x", max_tokens=0), 400,
                         "max_tokens must be at least 1, got 0", "max_tokens")
    assert error["type"] == "invalid_request_error"
    assert_error(post("/v1/completions", prompt="x", max_tokens=300), 400,
                 f"This model's maximum context length is {MAX_MODEL_LEN} tokens", "max_tokens")
    assert_error(post("/v1/completions", prompt=[1000] * MAX_MODEL_LEN, max_tokens=1), 400,
                 f"maximum context length is {MAX_MODEL_LEN} tokens")
    assert_error(post("/v1/completions", prompt="x", temperature=5), 400,
                 "temperature must be between 0 and 2, got 5", "temperature")
    assert_error(post("/v1/completions", prompt="x", top_p=0), 400, "top_p", "top_p")
    assert_error(post("/v1/completions", prompt="x", n=0), 400, "n must be between", "n")
    assert_error(post("/v1/completions", prompt=""), 400, "prompt must not be empty", "prompt")
    assert_error(post("/v1/completions", prompt=[5, 10 ** 6]), 400, "outside the vocabulary")
    assert_error(post("/v1/completions", prompt="x", max_tokens="many"), 400, "max_tokens",
                 "max_tokens")
    assert_error(post("/v1/completions", prompt="x", logprobs=21), 400,
                 "logprobs must be an integer between 0 and 20, got 21", "logprobs")
    # Everything this server does not implement is refused by name, never silently ignored.
    assert_error(post("/v1/completions", prompt="x", min_tokens=4), 400,
                 "min_tokens is not supported", "min_tokens")
    for field, value in (("repetition_penalty", 0), ("presence_penalty", 3),
                         ("frequency_penalty", -2.5), ("min_p", 1.5)):
        assert_error(post("/v1/completions", prompt="x", **{field: value}), 400,
                     f"{field} must be", field)
    assert_error(post("/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                      temprature=0.5), 400, "temprature is not a field this server knows",
                 "temprature")
    assert_error(post("/v1/completions", prompt="x", max_completion_tokens=4), 400,
                 "max_completion_tokens is not a field", "max_completion_tokens")
    assert_error(post("/v1/completions", prompt="x", stop=[""]), 400, "stop strings", "stop")
    assert_error(post("/v1/completions"), 400, "prompt is required", "prompt")
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404,
                 "'gpt-9' does not exist")
    assert_error(post("/v1/chat/completions", messages=[]), 400, "at least one message",
                 "messages")
    assert_error(post("/v1/chat/completions", messages=[{"role": "wizard", "content": "hi"}]),
                 400, "messages.0.role", "messages.0.role")
    bad_json = http.post("/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert_error(bad_json, 400, "not valid JSON")
    # The official client turns the same shape into its typed error.
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        oai.completions.create(model="smollm2", prompt="x", max_tokens=0)
    assert_still_serving(oai)


def test_with_auth_token_every_endpoint_but_health_wants_it_as_api_key(server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as anonymous:
        assert anonymous.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": AUTH_TOKEN}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
                reply = anonymous.request(method, path, headers=headers,
                                          json={"model": "smollm2", "prompt": "x"})
                assert reply.status_code == 401, (path, headers, reply.text)
                assert reply.json()["error"]["code"] == "invalid_api_key"
                assert "--auth-token" in reply.json()["error"]["message"]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_request_timeout_ends_it_with_finish_reason_timeout(http, rpc) -> None:
    reply = http.post("/v1/completions", json={
        "model": "smollm2", "prompt": [1000, 1001, 1002], "max_tokens": 240, "temperature": 0,
        "ignore_eos": True, "timeout": 0.5})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["finish_reason"] == "timeout"
    assert 0 < body["usage"]["completion_tokens"] < 240
    assert wait_idle(rpc).kv_blocks_in_use == 0
    for bad in (0, -1):
        assert_error(http.post("/v1/completions", json={
            "model": "smollm2", "prompt": "x", "timeout": bad}), 400, "timeout", "timeout")


# ---------------------------------------------------------------------------- load

STREAMS = 200


async def _stream_all(base_url: str) -> list[tuple[str, int, bool]]:
    """STREAMS streaming completions at once: (text, completion tokens, saw [DONE]) each."""
    limits = httpx.Limits(max_connections=STREAMS + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, headers=API_KEY,
                                 limits=limits) as client:
        async def one(index: int) -> tuple[str, int, bool]:
            text, tokens, done = "", 0, False
            async with client.stream("POST", "/v1/completions", json={
                    "model": "smollm2", "prompt": [1000 + index % 50, 2000, 3000],
                    "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as reply:
                assert reply.status_code == 200
                async for line in reply.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        for choice in chunk["choices"]:
                            text += choice["text"]
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
            return text, tokens, done
        return await asyncio.gather(*(one(i) for i in range(STREAMS)))


@pytest.mark.timeout(600)
def test_two_hundred_concurrent_streams_each_complete_once(server, rpc, oai) -> None:
    before = wait_idle(rpc)
    scheduler = server.child("scheduler_proc")
    idle_rss = scheduler.memory_info().rss
    results = asyncio.run(_stream_all(server.base_url))
    assert all(done and tokens == 3 for _, tokens, done in results)
    after = wait_idle(rpc)
    assert after.num_finished - before.num_finished == STREAMS
    assert after.kv_blocks_in_use == 0 and after.num_running == after.num_waiting == 0
    growth_mib = (scheduler.memory_info().rss - idle_rss) / 2**20
    assert growth_mib < 8, f"the scheduler kept {growth_mib:.1f} MiB after 200 streams"
    # The same text as each prompt alone (greedy).
    for index in (0, 1, 49):
        alone = oai.completions.create(model="smollm2", prompt=[1000 + index, 2000, 3000],
                                       max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        assert results[index][0] == alone.choices[0].text


# ---------------------------------------------------------------------------- disconnects

def test_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(server, rpc) -> None:
    before = wait_idle(rpc)
    with httpx.Client(base_url=server.base_url, timeout=120, headers=API_KEY) as client:
        with client.stream("POST", "/v1/completions", json={
                "model": "smollm2", "prompt": [1000, 1001, 1002], "max_tokens": 240,
                "temperature": 0, "ignore_eos": True, "stream": True}) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            assert rpc.stats().kv_blocks_in_use > 0
    # The connection is closed here, 1 token into a 240-token request.
    after = wait_idle(rpc)
    assert after.kv_blocks_in_use == 0
    assert after.num_generated_tokens - before.num_generated_tokens < 240


def test_disconnect_while_waiting_for_a_whole_completion_aborts_it(server, rpc) -> None:
    """The client hangs up once the engine runs its request (on any device, however fast: the
    hang-up waits on the engine, not on a clock), long before its 250 tokens."""
    before = wait_idle(rpc)
    body = json.dumps({"model": "smollm2", "prompt": [1000, 1001, 1002], "max_tokens": 250,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {AUTH_TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])), 30) as sock:
        sock.sendall(head + body)
        wait_until(lambda: rpc.stats().num_running, 60, interval_s=0.01, what="the completion running")
    after = wait_idle(rpc)
    assert after.kv_blocks_in_use == 0
    assert after.num_generated_tokens - before.num_generated_tokens < 250


# ---------------------------------------------------------------------------- metrics

def scrape(http) -> dict[str, float]:
    reply = http.get("/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_parse_and_move_as_requests_complete(http, oai, rpc) -> None:
    """Names follow vLLM's (spmd: for vllm:, labelled with the model) where it has them."""
    wait_idle(rpc)
    before = scrape(http)
    model = "model_name=smollm2"
    for name in ("spmd:num_requests_running", "spmd:num_requests_waiting",
                 "spmd:kv_cache_usage_perc", "spmd:num_preemptions_total",
                 "spmd:time_to_first_token_seconds_count", "spmd:inter_token_latency_seconds_count",
                 "spmd:request_queue_time_seconds_count"):
        assert f"{name}{{{model}}}" in before, name
    for name in ("spmd_num_requests_swapped", "spmd_prefix_cache_hit_rate", "spmd_thermal_throttling",
                 "spmd_running_cap"):
        assert f"{name}{{{model}}}" in before, name
    list(oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0,
                                stream=True, extra_body={"ignore_eos": True}))
    after = scrape(http)

    def moved(name: str) -> float:
        key = f"{name}{{{model}}}"
        return after[key] - before.get(key, 0)

    assert moved("spmd:generation_tokens_total") == 5
    assert moved("spmd:prompt_tokens_total") > 0
    assert moved("spmd:time_to_first_token_seconds_count") == 1
    assert moved("spmd:request_queue_time_seconds_count") == 1
    assert moved("spmd:inter_token_latency_seconds_count") == 4
    key = f"spmd:request_success_total{{finished_reason=length,{model}}}"
    assert after[key] == before.get(key, 0) + 1
    assert after[f"spmd:num_requests_running{{{model}}}"] == 0
    assert after[f"spmd:kv_cache_usage_perc{{{model}}}"] == 0


# ---------------------------------------------------------------------------- admin

def test_admin_batch_needs_the_bearer_token(server, http, rpc) -> None:
    body = {"force_evict": 1, "dry_run": True}
    assert_error(http.post("/v1/admin/batch", json=body), 401, "Authorization: Bearer")
    assert_error(http.post("/v1/admin/batch", json=body,
                           headers={"Authorization": "Bearer wrong"}), 401, "admin token")
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert_error(http.post("/v1/admin/batch", json={"policy": "random"}, headers=auth), 400,
                 "policy", "policy")
    wait_idle(rpc)
    with httpx.Client(base_url=server.base_url, timeout=120, headers=API_KEY) as client:
        with client.stream("POST", "/v1/completions", json={
                "model": "smollm2", "prompt": [1000, 1001], "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}) as running:
            # Keep the line iterator referenced: a dropped one closes the connection.
            lines = running.iter_lines()
            next(line for line in lines if line)
            reply = http.post("/v1/admin/batch", json=body, headers=auth)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["dry_run"] is True and result["previous_running"] == 1
    assert len(result["evicted_request_ids"]) == 1
    # The scheduler's own refusals come back as 400s with its message.
    assert_error(http.post("/v1/admin/batch", json={"force_evict": 5}, headers=auth), 400,
                 "force_evict")


# ---------------------------------------------------------------------------- supervision

def front_process(server) -> psutil.Process:
    for proc in descendants(server.proc.pid):
        if "spmd_runtime.runtime.serving" in proc.cmdline():
            return proc
    raise AssertionError("no HTTP front child of the launcher")


@pytest.mark.timeout(300)
def test_sigterm_stops_the_front_with_the_engine(spmd_serve, free_port, smollm2_gguf) -> None:
    """Also: a GGUF path is served under its file name, not its absolute path."""
    port = free_port()
    directory, name = smollm2_gguf
    srv = spmd_serve("--model", str(directory / name), "--max-model-len", "128", "--http-port",
                     str(port))
    try:
        srv.wait_serving()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert [card["id"] for card in http.get("/v1/models").json()["data"]] == [name]
        front = front_process(srv)
        assert srv.terminate() == 0, srv.stderr[-3000:]
        front.wait(30)
        assert not front.is_running() or front.status() == psutil.STATUS_ZOMBIE
    finally:
        srv.kill_tree()


@pytest.mark.timeout(300)
def test_a_dead_front_stops_the_whole_job(spmd_serve, free_port) -> None:
    """Also: --served-model-name is the name clients address the model by. (A tiny preset:
    what is served does not matter here, only the processes and the name.)"""
    port = free_port()
    srv = spmd_serve("--model", "dummy:tiny-llama", "--max-model-len", "128", "--http-port",
                     str(port), "--served-model-name", "team/chat-model")
    try:
        srv.wait_serving()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert [card["id"] for card in http.get("/v1/models").json()["data"]] == [
                "team/chat-model"]
            reply = http.post("/v1/completions", json={"model": "team/chat-model",
                                                       "prompt": [1000], "max_tokens": 1})
            assert reply.status_code == 200 and reply.json()["model"] == "team/chat-model"
            assert http.post("/v1/completions", json={"model": "smollm2", "prompt": [1000]}
                             ).status_code == 404
        front_process(srv).kill()
        assert srv.proc.wait(60) == 1
        assert "http front" in srv.stderr and "stopped the whole job" in srv.stderr
    finally:
        srv.kill_tree()
