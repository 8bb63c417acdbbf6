"""Bad input against a live server: a matrix of malformed frames, wrong types, bad values,
unknown ids and oversized frames, each answered with an error reply that says what is wrong
and counted, while a well-formed stream runs beside them and completes correctly. Also the
per-request deadline (timeout_s)."""
from __future__ import annotations

import math
import random
import threading

import msgspec
import pytest
from raw_socket import RawSocket
from sharp_llama import VOCAB, sharp_llama
from spmd_runtime.protocol.messages import AdminBatchRequest, ErrorReply
from spmd_runtime.runtime import Client, SamplingParams

MAX_MODEL_LEN = 256
MAX_MESSAGE_BYTES = 65536
STREAM_ID = 777
STREAM_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
STREAM_PARAMS = SamplingParams(max_tokens=MAX_MODEL_LEN - len(STREAM_PROMPT) - 1,
                               temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(spmd_serve, tmp_path_factory):
    model = sharp_llama(tmp_path_factory.mktemp("bad-input-llama"))[0]
    srv = spmd_serve("--model", model, "--num-kv-blocks", "64", "--max-model-len",
                     str(MAX_MODEL_LEN), "--max-message-bytes", str(MAX_MESSAGE_BYTES))
    with srv.serving():
        yield srv


def enc(value) -> bytes:
    return msgspec.msgpack.encode(value)


def add(*fields) -> bytes:
    """The positional wire form of AddRequest: tag, prompt, params, request_id, priority,
    timeout_s; params in SamplingParams' field order (max_tokens, temperature, top_p, top_k,
    seed, stop_token_ids, ignore_eos, cache_salt, then the penalties, min_p and stop)."""
    return enc(["add", 7, *fields])


# Every SamplingParams field at its default, in wire order: one more value is one too many.
ALL_SAMPLING_FIELDS = [getattr(SamplingParams(max_tokens=4), name)
                       for name in SamplingParams.__struct_fields__]

# (case, frame, what the error message must contain)
CASES = [
    ("empty frame", b"", "invalid request"),
    ("not msgpack", b"\xc1", "invalid request"),
    ("random bytes", random.Random(3).randbytes(64), "invalid request"),
    ("a bare integer", enc(42), "invalid request"),
    ("a map", enc({"tag": 1, "prompt": [1]}), "invalid request"),
    ("unknown message type", enc(["launch_missiles", 1]), "invalid request"),
    ("a list as the message type", enc([[], None]), "invalid request"),
    ("a worker's message", enc(["plan", 1, [], [], [], []]), "invalid request"),
    ("invalid UTF-8 as the type", b"\x92\xa2\xff\xfe\x01", "invalid request"),
    ("nested 10,000 deep", b"\x91" * 10_000 + b"\x00", "invalid request"),
    ("missing fields", enc(["add"]), "invalid request"),
    ("tag is a string", enc(["add", "seven", [1, 2]]), "invalid request"),
    ("prompt is a string", add("hello"), "invalid request"),
    ("token is a string", add([1, "a"]), "invalid request"),
    ("token is a float", add([1, 2.5]), "invalid request"),
    ("token past 64 bits", add([2**64 - 1]), "outside the vocabulary"),
    ("empty prompt", add([]), "prompt is empty"),
    ("negative token", add([-1]), "outside the vocabulary"),
    ("token = vocabulary size", add([VOCAB]), "outside the vocabulary"),
    ("prompt longer than the context", add([1] * (MAX_MODEL_LEN + 5)), "context"),
    ("max_tokens 0", add([1], [0]), "max_tokens"),
    ("max_tokens 3.5", add([1], [3.5]), "invalid request"),
    ("max_tokens a string", add([1], ["many"]), "invalid request"),
    ("temperature -1", add([1], [4, -1.0]), "temperature"),
    ("temperature NaN", add([1], [4, math.nan]), "temperature"),
    ("temperature inf", add([1], [4, math.inf]), "temperature"),
    ("top_p 0", add([1], [4, 1.0, 0.0]), "top_p"),
    ("top_p 1.5", add([1], [4, 1.0, 1.5]), "top_p"),
    ("top_k 0", add([1], [4, 1.0, 1.0, 0]), "top_k"),
    ("seed a string", add([1], [4, 1.0, 1.0, -1, "abc"]), "invalid request"),
    ("negative stop token", add([1], [4, 1.0, 1.0, -1, None, [-3]]), "stop_token_ids"),
    ("ignore_eos a string", add([1], [4, 1.0, 1.0, -1, None, [], "yes"]), "invalid request"),
    ("too many sampling fields", add([1], [*ALL_SAMPLING_FIELDS, 9]), "invalid request"),
    ("negative request id", add([1], [4], -5), "request_id must be >= 0"),
    ("request id in use", add([1], [4], STREAM_ID), "already in use"),
    ("priority a string", add([1], [4], None, "high"), "invalid request"),
    ("timeout 0", add([1], [4], None, 0, 0.0), "timeout_s must be"),
    ("timeout NaN", add([1], [4], None, 0, math.nan), "timeout_s must be"),
    ("abort of an unknown id", enc(["abort", 1, 99_999]), "unknown request id"),
    ("abort id a string", enc(["abort", 1, "x"]), "invalid request"),
    ("admin while disabled", enc(AdminBatchRequest(tag=1, force_evict=1)), "disabled"),
    ("prefix-cache reset while running", enc(["reset_prefix_cache", 1]), "cannot reset"),
    ("frame over --max-message-bytes", add([1] * MAX_MESSAGE_BYTES),
     f"--max-message-bytes {MAX_MESSAGE_BYTES}"),
]


@pytest.mark.timeout(300)
def test_bad_input_matrix_while_a_stream_runs(server) -> None:
    assert len(CASES) >= 30
    outcome: dict = {}
    started = threading.Event()

    def stream():
        with Client(server.address, timeout_s=60) as client:
            tokens = []
            for delta in client.stream(STREAM_PROMPT, STREAM_PARAMS, request_id=STREAM_ID):
                tokens += delta.token_ids
                started.set()
                outcome["finish_reason"] = delta.finish_reason
            outcome["tokens"] = tokens
    thread = threading.Thread(target=stream, daemon=True)
    with Client(server.address, timeout_s=60) as client:
        before = client.stats()
        thread.start()
        assert started.wait(60), "the well-formed stream did not start"
        raw = RawSocket(server.address)
        try:
            for case, frame, expected in CASES:
                raw.send(frame)
                reply = raw.recv()
                assert isinstance(reply, ErrorReply), (case, reply)
                assert expected in reply.message, (case, reply.message)
        finally:
            raw.close()
        thread.join(120)
        assert not thread.is_alive()
        after = client.stats()
        refused = (after.rejected_frames - before.rejected_frames
                   + after.invalid_requests - before.invalid_requests)
        assert refused == len(CASES)
        # The stream beside them is the same as the request alone, afterwards.
        assert outcome["finish_reason"] == "length"
        (alone,) = client.generate([STREAM_PROMPT], STREAM_PARAMS)
        assert outcome["tokens"] == alone.token_ids
        assert len(alone.token_ids) == STREAM_PARAMS.max_tokens


@pytest.mark.timeout(120)
def test_request_past_its_deadline_ends_with_timeout(server) -> None:
    with Client(server.address, timeout_s=60) as client:
        (out,) = client.generate([STREAM_PROMPT], STREAM_PARAMS, request_timeout_s=0.02)
        assert out.finish_reason == "timeout"
        assert len(out.token_ids) < STREAM_PARAMS.max_tokens
        (full,) = client.generate([STREAM_PROMPT], STREAM_PARAMS)
        assert full.token_ids[:len(out.token_ids)] == out.token_ids
        stats = client.stats()
        assert stats.num_running == 0 and stats.kv_blocks_in_use == 0
