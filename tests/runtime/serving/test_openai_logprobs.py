"""logprobs / top_logprobs through the HTTP front, driven by the official `openai` client: chat
and completions, streamed and not, in OpenAI's shapes, equal to what the engine's RPC Client
returns for the same request.

One server (a sharp tiny Llama with the vocabulary and tokenizer of SmolLM2, so it can chat).
"""
from __future__ import annotations

import math

import openai
import pytest
from conftest import openai_client
from sharp_llama import save_sharp
from spmd_runtime.runtime import Client, SamplingParams
from spmd_runtime.runtime.loaders import resolve_model
from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer

TOP = 3
MAX_TOKENS = 5
ATOL = 1e-4
PROMPT = [1, 504, 3458, 282, 4649, 314]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def server(spmd_serve, free_port, tmp_path_factory, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-chat-llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    save_sharp(directory, lambda: LlamaForCausalLM(config))
    tokenizer.save_pretrained(directory)
    port = free_port()
    srv = spmd_serve("--model", str(directory), "--max-model-len", "128", "--dtype", "float32",
                     "--device", "cpu", "--http-port", str(port))
    srv.base_url = f"http://127.0.0.1:{port}"
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server, "none") as client:
        yield client


@pytest.fixture(scope="module")
def engine_records(server):
    """The engine's own records for the completion prompt and the chat, through RPC."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    with Client(server.address, timeout_s=120) as client:
        client.wait_ready(120)
        completion = client.generate(PROMPT, params)[0]
        chat = client.generate([MESSAGES], params, chat=True)[0]
    return completion.logprobs, chat.logprobs


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=ATOL)


def check_completion(logprobs, records, tokenizer) -> None:
    """Legacy completions: tokens, token_logprobs, top_logprobs ({token: logprob}, the chosen
    token among them), text_offset."""
    assert logprobs.tokens == [tokenizer.decode([r.token_id]) for r in records]
    assert all(close(a, r.logprob) for a, r in zip(logprobs.token_logprobs, records, strict=True))
    for top, record in zip(logprobs.top_logprobs, records, strict=True):
        expected = {tokenizer.decode([t]): lp for t, lp in (*record.top, (record.token_id,
                                                                          record.logprob))}
        assert top.keys() == expected.keys()
        assert all(close(top[token], expected[token]) for token in top)
    lengths = [len(token) for token in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


def check_chat(content, records, tokenizer) -> None:
    assert len(content) == len(records) == MAX_TOKENS
    for entry, record in zip(content, records, strict=True):
        assert entry.token == tokenizer.decode([record.token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert close(entry.logprob, record.logprob)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t, _ in record.top]
        assert all(close(t.logprob, lp) for t, (_, lp) in zip(entry.top_logprobs, record.top,
                                                                 strict=True))


@pytest.mark.timeout(300)
def test_completions_logprobs_whole_and_streamed(oai, engine_records, tokenizer) -> None:
    records = engine_records[0]
    request = dict(model=None, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
                   extra_body={"ignore_eos": True})
    whole = oai.completions.create(**request).choices[0]
    assert len(whole.logprobs.tokens) == MAX_TOKENS
    check_completion(whole.logprobs, records, tokenizer)

    tokens, token_logprobs, top, offsets = [], [], [], []
    for chunk in oai.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
                top += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    assert (tokens, token_logprobs, top, offsets) == (
        whole.logprobs.tokens, whole.logprobs.token_logprobs, whole.logprobs.top_logprobs,
        whole.logprobs.text_offset)

    # n choices: each carries its own records.
    for choice in oai.completions.create(**request, n=2).choices:
        check_completion(choice.logprobs, records, tokenizer)


@pytest.mark.timeout(300)
def test_chat_logprobs_whole_and_streamed(oai, engine_records, tokenizer) -> None:
    records = engine_records[1]
    request = dict(model=None, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                   logprobs=True, top_logprobs=TOP, extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**request).choices[0]
    check_chat(whole.logprobs.content, records, tokenizer)

    content = []
    for chunk in oai.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                content += choice.logprobs.content
    check_chat(content, records, tokenizer)

    plain = oai.chat.completions.create(**{**request, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.message.content


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("endpoint", "fields", "param"), [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_values_are_refused_naming_the_field(oai, endpoint, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        if endpoint == "chat":
            oai.chat.completions.create(model=None, messages=MESSAGES, max_tokens=2, **fields)
        else:
            oai.completions.create(model=None, prompt=PROMPT, max_tokens=2, **fields)
    assert error.value.body["param"] == param, error.value.body
