"""The official `openai` client against `spmdrun serve --http-port`: every sampling parameter
the server takes (temperature, top_p, max_tokens, n, seed, stop, the presence and frequency
penalties, and vLLM's extensions repetition_penalty and min_p), on completions and chat,
streamed and not; /v1/models; best_of; the n choices of a prompt sharing its KV blocks; and the
Prometheus names that follow vLLM's.

One server per module: a tiny sharp Llama with smollm2's vocabulary and tokenizer, so requests
cost next to nothing. The reference is the same engine through the RPC Client with the same
SamplingParams (a seeded request samples the same whatever shares its batch).
"""
from __future__ import annotations

import contextlib
import random
import threading

import httpx
import openai
import pytest
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families
from sharp_llama import sharp_chat_llama
from spmd_runtime.runtime import Client, SamplingParams
from spmd_runtime.runtime.serving.metrics import (
    INTER_TOKEN_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from spmd_runtime.scheduler_proc.chat import chat_prompt_ids

MODEL = "tiny-chat"
MAX_MODEL_LEN = 128
BLOCK_SIZE = 16
MAX_NUM_SEQS = 2
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Sampled, reproducible, and long enough for every parameter to change something.
BASE = {"temperature": 1.0, "seed": 11, "max_tokens": 12}
# The penalties act on tokens already there, which this random model seldom picks again:
# negative ones (making it repeat) change its greedy output.
GREEDY = {"temperature": 0.0, "max_tokens": 24}
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# Each parameter at a value that changes the output of BASE on this model.
OPTIONS = {"temperature": 0.3, "top_p": 0.5, "top_k": 2, "seed": 12, "max_tokens": 5,
           "presence_penalty": -2.0, "frequency_penalty": -2.0, "repetition_penalty": 0.5,
           "min_p": 0.2}
# Not in the OpenAI API: the client sends them through extra_body.
EXTENSIONS = ("repetition_penalty", "min_p", "top_k", "stop_token_ids")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_gguf) -> str:
    return sharp_chat_llama(tmp_path_factory.mktemp("openai-llama"), smollm2_gguf)


@pytest.fixture(scope="module")
def server(spmd_serve, free_port, model_dir):
    port = free_port()
    srv = spmd_serve("--model", model_dir, "--dtype", "float32", "--served-model-name", MODEL,
                     "--max-model-len",
                     str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE), "--max-num-seqs",
                     str(MAX_NUM_SEQS), "--http-port", str(port))
    srv.base_url = f"http://127.0.0.1:{port}"
    with srv.serving():
        yield srv


def request_options(options: dict) -> dict:
    """The openai client's keyword arguments: extensions go in extra_body."""
    kwargs = {k: v for k, v in options.items() if k not in EXTENSIONS}
    extra = {k: v for k, v in options.items() if k in EXTENSIONS}
    return {**kwargs, "extra_body": {"ignore_eos": True, **extra}}


def engine_params(options: dict, choice: int = 0, stop: tuple[str, ...] = ()) -> SamplingParams:
    """What the server must send the engine for choice `choice` (its seed is seed + choice)."""
    params = dict(options)
    if params.get("seed") is not None:
        params["seed"] += choice
    params["stop_token_ids"] = tuple(params.get("stop_token_ids", ()))
    return SamplingParams(ignore_eos=True, stop=stop, **params)


def reference(rpc: Client, prompt, options: dict, n: int = 1, stop: tuple[str, ...] = ()):
    return rpc.generate([prompt] * n, [engine_params(options, k, stop) for k in range(n)])


def create(oai, chat: bool, stream: bool, n: int, options: dict, stop=None):
    """(texts by choice index, finish reasons by index, usage) of one request."""
    kwargs = request_options(options)
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    if chat:
        reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=n, stop=stop,
                                            stream=stream, **kwargs)
    else:
        reply = oai.completions.create(model=MODEL, prompt=PROMPT, n=n, stop=stop,
                                       stream=stream, **kwargs)
    texts, reasons, usage = [""] * n, [None] * n, None
    for chunk in (reply if stream else [reply]):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if chat:
                content = choice.delta.content if stream else choice.message.content
            else:
                content = choice.text
            texts[choice.index] += content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons, usage


def wait_idle(rpc: Client):
    """Stats once nothing runs or waits."""
    def idle():
        stats = rpc.stats()
        return None if stats.num_running or stats.num_waiting else stats
    return wait_until(idle, 60, what="an idle engine")


# ---------------------------------------------------------------------------- parameters

def test_models_lists_the_served_model(oai) -> None:
    (card,) = oai.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_parameter_reaches_the_engine(oai, rpc, name) -> None:
    base = GREEDY if name in PENALTIES else BASE
    options = {**base, name: OPTIONS[name]}
    (expected,) = reference(rpc, PROMPT, options)
    (without,) = reference(rpc, PROMPT, base)
    assert expected.token_ids != without.token_ids, f"{name} changes nothing on this model"
    texts, reasons, usage = create(oai, chat=False, stream=False, n=1, options=options)
    assert texts == [expected.text]
    assert reasons == [expected.finish_reason]
    assert usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_parameter_at_once_with_n_and_stop(oai, rpc, chat, stream) -> None:
    prompt = chat_prompt_ids(rpc.tokenizer, MESSAGES) if chat else PROMPT
    # The first seed whose two choices (seed and seed + 1) differ: which one does depends on
    # the device's random stream (CUDA's is not the CPU's); if seeds changed nothing, none would.
    for seed in range(OPTIONS["seed"], OPTIONS["seed"] + 8):
        options = {**OPTIONS, "seed": seed, "max_tokens": 16, "top_p": 0.9, "min_p": 0.05}
        free = reference(rpc, prompt, options, n=2)
        if free[0].text != free[1].text:
            break
    assert free[0].text != free[1].text, "choice i samples with seed + i"
    middle = len(free[0].text) // 2
    stop = free[0].text[middle:middle + 3]
    assert stop.strip(), free[0].text
    expected = reference(rpc, prompt, options, n=2, stop=(stop, "never appears"))
    assert expected[0].text == free[0].text[:free[0].text.index(stop)]
    texts, reasons, usage = create(oai, chat, stream, n=2, options=options,
                                   stop=[stop, "never appears"])
    assert texts == [e.text for e in expected]
    assert reasons == [e.finish_reason for e in expected]
    assert reasons[0] == "stop"
    assert usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_stop_token_ids_end_the_request(oai, rpc) -> None:
    (free,) = reference(rpc, PROMPT, BASE)
    options = {**BASE, "stop_token_ids": [free.token_ids[3]]}
    (expected,) = reference(rpc, PROMPT, options)
    assert expected.token_ids == free.token_ids[:4] and expected.finish_reason == "stop"
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, **request_options(options))
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 4


def test_chat_takes_max_completion_tokens(oai, rpc) -> None:
    options = {**BASE, "max_tokens": 3}
    (expected,) = reference(rpc, chat_prompt_ids(rpc.tokenizer, MESSAGES), options)
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3,
                                        seed=BASE["seed"], temperature=BASE["temperature"],
                                        extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == 3


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(oai, rpc) -> None:
    """best_of=4, n=2: the server samples candidates with seeds seed..seed+3 and returns the two
    whose sampled tokens have the highest summed logprob, as choices 0 and 1, counting every
    candidate's tokens in usage; logprobs only when asked for."""
    candidates = reference(rpc, PROMPT, {**BASE, "logprobs": 0}, n=4)
    scores = [sum(record.logprob for record in c.logprobs) for c in candidates]
    assert len({c.text for c in candidates}) == 4, "seeded candidates differ"
    best = sorted(range(4), key=lambda k: -scores[k])[:2]
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4,
                                   **request_options(BASE))
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [candidates[k].text for k in best]
    assert all(c.logprobs is None for c in reply.choices)
    assert reply.usage.completion_tokens == 4 * BASE["max_tokens"]
    with_logprobs = oai.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4,
                                           logprobs=1, **request_options(BASE))
    assert [sum(c.logprobs.token_logprobs) for c in with_logprobs.choices] == pytest.approx(
        [scores[k] for k in best], abs=1e-4)


def test_best_of_equal_to_n_is_served_and_bad_values_are_refused(oai) -> None:
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=2, **BASE)
    assert len(reply.choices) == 2
    with pytest.raises(openai.BadRequestError, match="best_of must be at least n"):
        oai.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=1, **BASE)
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        oai.completions.create(model=MODEL, prompt=PROMPT, n=1, best_of=2, stream=True, **BASE)


# ---------------------------------------------------------------------------- shared prompt

@contextlib.contextmanager
def full_batch(server, rpc: Client):
    """Two requests fill the batch (--max-num-seqs 2) until they finish together: what is
    submitted meanwhile waits in the queue. (Should they be gone before that is seen, the
    test goes on with a batch that has room: it then only checks less.)"""
    def run() -> None:
        with Client(server.address, timeout_s=120) as client:
            client.generate([[900, 901], [902, 903]],
                            SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    blockers = threading.Thread(target=run, daemon=True)
    blockers.start()
    try:
        wait_until(lambda: rpc.stats().num_running == MAX_NUM_SEQS or not blockers.is_alive(),
                   60, what="a full batch")
        yield
    finally:
        blockers.join(120)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_choices_share_the_prompts_blocks(server, oai, rpc, stream) -> None:
    """The prompt is computed once: every other choice finds its full blocks in the prefix
    cache. The choices are queued behind a full batch, where choices submitted with their
    first would all be admitted with it and compute the prompt again. Seeded choices differ,
    and come back the same when asked again."""
    n, full_blocks = 4, 2
    prompt = random.Random(f"share-{stream}").sample(range(1000, 40000),
                                                     full_blocks * BLOCK_SIZE + 5)

    def sample() -> list[str]:
        reply = oai.completions.create(model=MODEL, prompt=prompt, n=n, stream=stream,
                                       **request_options(BASE))
        texts = [""] * n
        for chunk in (reply if stream else [reply]):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        return texts

    wait_idle(rpc)
    with full_batch(server, rpc):
        before = rpc.stats()
        first = sample()
    after = wait_idle(rpc)
    assert after.prefix_cache_queries - before.prefix_cache_queries == n * len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == \
        (n - 1) * full_blocks * BLOCK_SIZE
    assert len(set(first)) > 1
    assert first == [o.text for o in reference(rpc, prompt, BASE, n=n)]
    assert sample() == first


# ---------------------------------------------------------------------------- metrics

def scrape(base_url: str) -> dict:
    reply = httpx.get(f"{base_url}/metrics", timeout=60)
    assert reply.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(reply.text)}


def samples(family, suffix: str = "") -> list:
    return [s for s in family.samples if s.name == family.name + suffix]


def test_metrics_follow_vllm_names_and_buckets(server, oai, rpc) -> None:
    wait_idle(rpc)
    oai.completions.create(model=MODEL, prompt=PROMPT, **request_options(BASE))
    families = scrape(server.base_url)
    histograms = {"spmd:time_to_first_token_seconds": TTFT_BUCKETS,
                  "spmd:inter_token_latency_seconds": INTER_TOKEN_BUCKETS,
                  "spmd:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
                  "spmd:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS}
    for name, buckets in histograms.items():
        family = families[name]
        assert family.type == "histogram", name
        edges = [float(s.labels["le"]) for s in samples(family, "_bucket")]
        assert edges == [*buckets, float("inf")], name
        (count,) = samples(family, "_count")
        assert count.labels == {"model_name": MODEL} and count.value >= 1, name
    for name in ("spmd:num_requests_running", "spmd:num_requests_waiting",
                 "spmd:kv_cache_usage_perc"):
        assert families[name].type == "gauge", name
        assert samples(families[name])[0].labels == {"model_name": MODEL}
    for name in ("spmd:prefix_cache_queries", "spmd:prefix_cache_hits", "spmd:num_preemptions",
                 "spmd:prompt_tokens", "spmd:generation_tokens", "spmd:request_success"):
        assert families[name].type == "counter", name
        assert samples(families[name], "_total"), name
    reasons = {s.labels["finished_reason"]: s.value
               for s in samples(families["spmd:request_success"], "_total")}
    assert reasons["length"] >= 1
    # Metrics without a vLLM counterpart keep their own prefix.
    assert "spmd_num_requests_swapped" in families and "spmd_running_cap" in families
