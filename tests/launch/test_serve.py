"""`spmdrun serve` on a free TCP port, used by clients in this and other processes.

One server per module (smollm2, --max-model-len 256). Covers concurrent clients from another
process, refusal of bad input with a clear error while the server keeps serving, streaming,
and stats.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
from raw_socket import RawSocket
from spmd_runtime.protocol.messages import (
    AbortDone,
    AddRequest,
    EngineStats,
    ErrorReply,
    ModelInfo,
    Outputs,
    RequestAccepted,
    StatsRequest,
)
from spmd_runtime.runtime import Client, SamplingParams

MAX_MODEL_LEN = 256
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(spmd_serve):
    srv = spmd_serve("--model", "smollm2", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN))
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def client(rpc):
    """conftest's RPC client of this module's server."""
    return rpc


@pytest.fixture(scope="module")
def tokenizer(hf_smollm2):
    return hf_smollm2[1]


def assert_still_serving(client: Client) -> None:
    (out,) = client.generate([[1000, 2000, 3000]], SamplingParams(max_tokens=2, temperature=0.0,
                                                                   ignore_eos=True))
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_serving_line_and_model_info(server, client) -> None:
    assert f"serving smollm2 on {server.address}" in server.stdout
    info = client.model_info()
    assert isinstance(info, ModelInfo)
    assert info.model == "smollm2" and info.max_model_len == MAX_MODEL_LEN
    assert info.vocab_size == 49152 and info.eos_token_ids == [2] and info.world_size == 1


CONCURRENT_SCRIPT = textwrap.dedent("""
    import json, sys, threading
    from spmd_runtime.runtime import Client, SamplingParams

    address = sys.argv[1]
    prompts = json.loads(sys.stdin.read())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = [None] * len(prompts)
    errors = []
    barrier = threading.Barrier(len(prompts))

    def run(index):
        try:
            with Client(address, timeout_s=120) as client:   # one Client per thread
                client.wait_ready(120)
                barrier.wait()
                (out,) = client.generate([prompts[index]], params)
                results[index] = out.token_ids
        except BaseException as error:
            errors.append(repr(error))
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"results": results, "errors": errors}))
""")

TOPICS = ["The weather today is", "My favourite animal is the", "In 1969, astronauts",
          "def add(a, b):\n", "The best way to learn programming is", "Paris is famous for",
          "Once upon a time", "The recipe calls for two cups of", "1, 2, 3, 4,",
          "Dear Sir or Madam, I am writing to", "The stock market fell sharply after",
          "Water boils at", "The quick brown fox", "Mount Everest is the",
          "A haiku about autumn:\n", "Q: What is 7 times 8?\nA:"]


@pytest.mark.timeout(420)
def test_concurrent_clients_in_another_process_match_one_by_one(server, client, tokenizer,
                                                                hf_smollm2, greedy_reference):
    prompts = [list(tokenizer(t).input_ids) for t in TOPICS]
    assert len(prompts) == 16
    before = client.stats()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", CONCURRENT_SCRIPT, server.address],
                          input=json.dumps(prompts), capture_output=True, text=True,
                          timeout=300, cwd=_repo_root(), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == []
    concurrent = report["results"]
    middle = client.stats()
    # Batched: far fewer steps than the 16 x 6 a one-by-one run takes.
    assert middle.num_steps - before.num_steps <= 48, (before, middle)
    one_by_one = [client.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert all(len(c) == 6 for c in concurrent)
    model, _ = hf_smollm2
    # Batching may only flip genuine near-ties (see conftest); expect all 16 identical.
    greedy_reference.check(model, prompts, concurrent, one_by_one, min_exact=15)


def _repo_root() -> str:
    from pathlib import Path
    return str(Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------------------- bad input

def test_empty_prompt_is_refused(client) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        client.generate([[]], GREEDY)
    assert_still_serving(client)


def test_prompt_longer_than_the_context_is_refused(client) -> None:
    with pytest.raises(ValueError, match=rf"{MAX_MODEL_LEN} tokens.*shorten the prompt"):
        client.generate([[1000] * (MAX_MODEL_LEN + 20)], GREEDY)
    with pytest.raises(ValueError, match="shorten"):
        client.generate([[1000] * MAX_MODEL_LEN], GREEDY)
    assert_still_serving(client)


def test_prompt_that_exactly_fills_the_context_but_one_is_served(client) -> None:
    (out,) = client.generate([[1000] * (MAX_MODEL_LEN - 1)],
                             SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_token_outside_the_vocabulary_is_refused(client) -> None:
    vocab = client.model_info().vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.generate([[5, vocab]], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.generate([[5, -1]], GREEDY)
    assert_still_serving(client)


def test_one_bad_prompt_in_a_batch_names_it_and_aborts_the_others(client) -> None:
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        client.generate([[1000, 1001], [], [1002]], SamplingParams(max_tokens=250,
                                                                 temperature=0.0,
                                                                 ignore_eos=True))
    # The two accepted prompts were aborted, not left running for 250 tokens.
    deadline = time.monotonic() + 10
    while (stats := client.stats()).num_running or stats.num_waiting:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats.kv_blocks_in_use == 0
    assert_still_serving(client)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -1.0}),
    ("temperature", {"temperature": math.nan}), ("top_p", {"top_p": 0.0})])
def test_invalid_sampling_params_cannot_even_be_built(field, kwargs) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture()
def raw(server):
    sock = RawSocket(server.address)
    yield sock
    sock.close()


# Positional wire form of SamplingParams: [max_tokens, temperature, top_p, top_k, ...]
@pytest.mark.parametrize(("field", "wire_params"), [
    ("max_tokens", [0]), ("temperature", [16, -1.0]), ("temperature", [16, math.nan]),
    ("top_p", [16, 1.0, 0.0]), ("top_k", [16, 1.0, 1.0, 0])],
    ids=["max_tokens=0", "temperature=-1", "temperature=nan", "top_p=0", "top_k=0"])
def test_invalid_params_on_the_wire_get_an_error_reply(raw, client, field, wire_params) -> None:
    raw.send(msgspec.msgpack.encode(["add", 41, [1000, 1001, 1002], wire_params]))
    reply = raw.recv()
    assert isinstance(reply, ErrorReply), reply
    assert field in reply.message and "invalid request" in reply.message
    # The client's tag is recovered, so it knows which of its requests was refused.
    assert reply.tag == 41 and reply.request_id is None
    # The same socket still works for a valid request.
    raw.send(msgspec.msgpack.encode(AddRequest(tag=42, prompt_token_ids=[1000, 1001],
                                               params=SamplingParams(max_tokens=2,
                                                                     temperature=0.0))))
    reply = raw.recv()
    assert isinstance(reply, RequestAccepted) and reply.tag == 42
    tokens, finished = [], None
    while finished is None:
        message = raw.recv(120)
        if isinstance(message, Outputs):
            for delta in message.deltas:
                assert delta.request_id == reply.request_id
                tokens += delta.token_ids
                finished = delta.finish_reason or finished
    assert len(tokens) == 2 or finished == "stop"
    assert_still_serving(client)


def test_garbage_frames_get_an_error_reply_without_a_tag(raw, client) -> None:
    # Strings with invalid UTF-8 (bare, and as a message tag) once crashed the scheduler.
    for payload in (os.urandom(64), b"", b"\x93\x01\x02", msgspec.msgpack.encode({"add": 1}),
                    msgspec.msgpack.encode(["plan", 1, [], [], [], []]), b"\xa2\xff\xfe",
                    b"\x92\xa2\xff\xfe\x01", b"\x93\xa3add\x01\xa1\xff"):
        raw.send(payload)
        reply = raw.recv()
        assert isinstance(reply, ErrorReply), (payload, reply)
        assert reply.tag is None and reply.message.startswith("invalid request")
    # Multi-frame garbage too.
    raw.sock.send_multipart([b"x", os.urandom(16), b"\xc1"])
    reply = raw.recv()
    assert isinstance(reply, ErrorReply) and reply.tag is None
    raw.send(msgspec.msgpack.encode(StatsRequest(tag=9)))
    reply = raw.recv()
    assert isinstance(reply, EngineStats) and reply.tag == 9
    assert_still_serving(client)


def test_unknown_request_id_on_abort(client) -> None:
    with pytest.raises(ValueError, match="unknown request id"):
        client.abort(987654)
    assert_still_serving(client)


def test_request_id_in_use_is_refused(client) -> None:
    stream = client.stream([1000, 1001, 1002], SamplingParams(max_tokens=200, temperature=0.0,
                                                              ignore_eos=True),
                           request_id=424242)
    first = next(stream)
    assert first.request_id == 424242
    with Client(client.address, timeout_s=60) as other:
        with pytest.raises(ValueError, match="already in use"):
            list(other.stream([1000], GREEDY, request_id=424242))
        other.abort(424242)
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert_still_serving(client)


# ---------------------------------------------------------------------------- streaming, stats

@pytest.mark.timeout(300)
def test_stream_deltas_add_up_to_generate(client) -> None:
    prompt = "Write a sentence about the moon:"
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    deltas = list(client.stream(prompt, params))
    (full,) = client.generate([prompt], params)
    assert len(deltas) >= 2, "a stream should deliver tokens as they come"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert len({d.request_id for d in deltas}) == 1


@pytest.mark.timeout(300)
def test_stream_of_token_ids_carries_the_engine_text(client) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with Client(client.address, timeout_s=60) as bare:
        deltas = list(bare.stream([1000, 1001], params))
        (full,) = bare.generate([[1000, 1001]], params)
    assert sum(len(d.token_ids) for d in deltas) == 3
    assert "".join(d.text for d in deltas) == full.text


def test_stop_token_ids_end_a_request(client) -> None:
    prompt = [1000, 2000, 3000, 4000]
    (free,) = client.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                       ignore_eos=True))
    stop = free.token_ids[3]
    cut = free.token_ids.index(stop) + 1
    (stopped,) = client.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                          ignore_eos=True,
                                                          stop_token_ids=(stop,)))
    assert stopped.token_ids == free.token_ids[:cut]
    assert stopped.finish_reason == "stop"


def test_stats(client) -> None:
    before = client.stats()
    assert isinstance(before, EngineStats)
    assert before.kv_blocks_total > 0
    assert before.kv_blocks_free + before.kv_blocks_in_use == before.kv_blocks_total
    client.generate([[1000, 1001, 1002, 1003]], SamplingParams(max_tokens=3, temperature=0.0,
                                                               ignore_eos=True))
    after = client.stats()
    assert after.num_finished == before.num_finished + 1
    assert after.num_prompt_tokens == before.num_prompt_tokens + 4
    assert after.num_generated_tokens == before.num_generated_tokens + 3
    assert after.num_steps >= before.num_steps + 3
    assert after.num_running == 0 and after.num_waiting == 0
    assert after.kv_blocks_in_use == 0 and after.kv_blocks_free == after.kv_blocks_total


def test_abort_reply_over_the_wire(raw) -> None:
    raw.send(msgspec.msgpack.encode(AddRequest(
        tag=1, prompt_token_ids=[1000, 1001],
        params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))))
    accepted = raw.recv()
    assert isinstance(accepted, RequestAccepted)
    raw.send(msgspec.msgpack.encode(["abort", 2, accepted.request_id]))
    seen_done = seen_abort_delta = False
    while not (seen_done and seen_abort_delta):
        message = raw.recv(60)
        if isinstance(message, AbortDone):
            assert message.tag == 2 and message.request_id == accepted.request_id
            seen_done = True
        elif isinstance(message, Outputs):
            seen_abort_delta |= any(d.finish_reason == "abort" for d in message.deltas)
