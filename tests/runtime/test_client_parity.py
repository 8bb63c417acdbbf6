"""Client and AsyncClient are two faces of one core (runtime/client_core.py): the same public
methods with the same parameters and defaults, and, against one live engine, the same greedy
outputs and the same error messages."""
from __future__ import annotations

import asyncio
import inspect

import pytest
from engine_idle import wait_idle
from sharp_llama import sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams
from spmd_runtime.runtime.async_client import AsyncClient
from spmd_runtime.runtime.client import Client
from spmd_runtime.runtime.client_core import READY_TIMEOUT_S, TIMEOUT_S

# Methods only one face has, and why.
SYNC_ONLY = {
    "__enter__", "__exit__",     # its context manager; AsyncClient's is async with
    # The served model's tokenizer, loaded in this process (transformers, the model files):
    # blocking work; the HTTP front loads its own in a thread.
    "tokenizer", "encode",
}
ASYNC_ONLY = {
    "__aenter__", "__aexit__",
    # The HTTP front's building block: the accepted request's RequestStream of raw deltas, whose
    # close() aborts without awaiting (safe in a cancelled task's finally); stream() is built
    # on it.
    "submit",
}
# Constructor parameters only one face takes: a tokenizer to reuse, for `tokenizer`.
SYNC_ONLY_PARAMETERS = {"tokenizer"}
# Not awaited on the async face either: closing, and an abort sent without waiting for its reply.
NOT_AWAITED = {"__init__", "close", "abort_nowait"}


def public_methods(cls: type) -> set[str]:
    dunders = {name for klass in cls.__mro__ if klass is not object
               for name in vars(klass) if name.startswith("__") and name.endswith("__")
               and callable(vars(klass)[name]) and name not in ("__init_subclass__",)}
    return {name for name in dir(cls) if not name.startswith("_")} | (
        dunders & {"__init__", "__enter__", "__exit__", "__aenter__", "__aexit__"})


def described(cls: type, name: str) -> tuple[list[tuple], str]:
    """(name, kind, default, annotation) of each parameter, and the return annotation, as the
    source spells them; an async iterator returns what the sync face's iterator does."""
    signature = inspect.signature(getattr(cls, name))
    parameters = [(p.name, p.kind, p.default, str(p.annotation))
                  for p in signature.parameters.values()
                  if not (name == "__init__" and p.name in SYNC_ONLY_PARAMETERS)]
    returns = str(signature.return_annotation).replace("AsyncIterator[", "Iterator[")
    return parameters, returns.replace("AsyncClient", "Client")


def test_public_methods_are_the_same_on_both_faces() -> None:
    sync, async_ = public_methods(Client), public_methods(AsyncClient)
    assert sync - async_ == SYNC_ONLY
    assert async_ - sync == ASYNC_ONLY


@pytest.mark.parametrize("name", sorted(public_methods(Client) & public_methods(AsyncClient)))
def test_shared_methods_have_the_same_signature(name: str) -> None:
    assert described(Client, name) == described(AsyncClient, name)
    method = getattr(AsyncClient, name)
    awaited = inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)
    assert awaited == (name not in NOT_AWAITED), f"AsyncClient.{name} should be async"


def test_one_set_of_timeout_defaults() -> None:
    for cls in (Client, AsyncClient):
        assert inspect.signature(cls).parameters["timeout_s"].default == TIMEOUT_S == 30.0
        assert inspect.signature(cls.wait_ready).parameters["timeout_s"].default \
            == READY_TIMEOUT_S


# ---------------------------------------------------------------------------- one live engine

VOCAB = 256
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2], [100, 101, 102, 103, 104], [7] * 9]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = sharp_llama(tmp_path_factory.mktemp("sharp-llama"), vocab=VOCAB)[0]
    with LLM(model, num_kv_blocks=64, max_model_len=128, max_num_seqs=8, dtype="float32",
             device="cpu") as engine:
        yield engine


def through_both(llm: LLM, call):
    """call(client) on a Client and (awaited) on an AsyncClient of the engine: each one's
    result, or its exception."""
    def outcome(run):
        try:
            return run()
        except Exception as error:   # compared between the faces
            return error

    def sync():
        with Client(llm.config.rpc_address) as client:
            return call(client)

    async def run_async():
        async with AsyncClient(llm.config.rpc_address) as client:
            return await call(client)

    return outcome(sync), outcome(lambda: asyncio.run(run_async()))


def collect_stream(client, *args, **kwargs):
    """The deltas of client.stream(...) as a list, from either face."""
    if isinstance(client, Client):
        return list(client.stream(*args, **kwargs))

    async def collect():
        return [delta async for delta in client.stream(*args, **kwargs)]
    return collect()


@pytest.mark.timeout(300)
def test_both_faces_give_the_same_greedy_outputs(llm) -> None:
    finished: dict[str, list[int]] = {"sync": [], "async": []}

    def generate(client):
        face = "sync" if isinstance(client, Client) else "async"
        return client.generate(PROMPTS, GREEDY, priority=[0, 5, 1], request_timeout_s=60.0,
                               on_finished=lambda output: finished[face].append(output.request_id))
    sync, async_ = through_both(llm, generate)
    assert [o.token_ids for o in sync] == [o.token_ids for o in async_]
    assert [o.prompt_token_ids for o in sync] == [o.prompt_token_ids for o in async_] == PROMPTS
    assert [len(o.token_ids) for o in sync] == [6, 6, 6]
    assert {o.finish_reason for o in sync + async_} == {"length"}
    assert sorted(finished["sync"]) == sorted(o.request_id for o in sync)
    assert sorted(finished["async"]) == sorted(o.request_id for o in async_)
    # One prompt, one SamplingParams: the same as the batch's first output.
    single = through_both(llm, lambda client: client.generate(PROMPTS[0], GREEDY))
    assert [o.token_ids for (o,) in single] == [sync[0].token_ids] * 2
    # Streamed: the same tokens, in deltas of the same shape.
    deltas = through_both(llm, lambda client: collect_stream(client, PROMPTS[1], GREEDY,
                                                              priority=3))
    for face in deltas:
        assert [t for d in face for t in d.token_ids] == sync[1].token_ids
        assert face[-1].finish_reason == "length"
    assert [type(d).__name__ for d in deltas[0]] == [type(d).__name__ for d in deltas[1]]
    assert_idle(llm)


BAD_CALLS = {
    "params a dict": lambda c: c.generate(PROMPTS, {"max_tokens": 0}),
    "params per prompt, too few": lambda c: c.generate(PROMPTS, [GREEDY, GREEDY]),
    "priorities per prompt, too many": lambda c: c.generate(PROMPTS, GREEDY, [1, 2, 3, 4]),
    "priority a string": lambda c: c.generate(PROMPTS, GREEDY, priority="high"),
    "no prompts": lambda c: c.generate([], GREEDY),
    "a conversation without chat": lambda c: c.generate(
        [[{"role": "user", "content": "hi"}]], GREEDY),
    "token ids as a chat prompt": lambda c: c.generate(PROMPTS, GREEDY, chat=True),
    # Refused by the engine: the first refused prompt is named, the others aborted.
    "a token outside the vocabulary": lambda c: c.generate([[1, 2], [VOCAB + 44], [3]], GREEDY),
    "a text to an engine without a tokenizer": lambda c: c.generate(["hello"], GREEDY),
    "a request timeout of 0": lambda c: c.generate(PROMPTS, GREEDY, request_timeout_s=0),
    "an unknown option": lambda c: c.generate(PROMPTS, GREEDY, max_tokens=0),
    "stream: params a dict": lambda c: collect_stream(c, PROMPTS[0], {"max_tokens": 0}),
    "stream: a negative request id": lambda c: collect_stream(c, PROMPTS[0], GREEDY, -3),
    "abort: an unknown request id": lambda c: c.abort(987654),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_both_faces_refuse_a_bad_call_with_the_same_error(llm, case: str) -> None:
    sync, async_ = through_both(llm, BAD_CALLS[case])
    assert isinstance(sync, Exception), f"{case}: the sync face accepted it"
    assert type(sync) is type(async_), (sync, async_)
    # A Python-level TypeError names the method with its class: the rest must match.
    assert str(sync).replace("Client.", "") == str(async_).replace("AsyncClient.", ""), \
        (sync, async_)
    assert isinstance(sync, ValueError) or case == "an unknown option", sync
    assert_idle(llm)


def assert_idle(llm: LLM) -> None:
    stats = wait_idle(llm.client)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.timeout(300)
def test_generate_gets_each_output_in_one_frame_and_stream_a_frame_a_token(llm) -> None:
    """What both faces build on: generate()'s requests (stream=False) get their whole output in
    one delta when they end; a streamed request a delta per step."""
    import msgspec
    from raw_socket import RawSocket
    from spmd_runtime.protocol.messages import AddRequest, Outputs, RequestAccepted
    from spmd_runtime.runtime.client_core import add_request

    assert add_request(1, PROMPTS[0], GREEDY).stream
    with Client(llm.config.rpc_address) as client:
        assert not any(r.stream for r in client._batch_requests(PROMPTS, GREEDY, 0, None, False))
    raw = RawSocket(llm.config.rpc_address)
    try:
        for stream in (False, True):
            raw.send(msgspec.msgpack.encode(AddRequest(tag=1, prompt_token_ids=PROMPTS[2],
                                                       params=GREEDY, stream=stream)))
            assert isinstance(raw.recv(), RequestAccepted)
            frames = []
            while not frames or frames[-1].deltas[-1].finish_reason is None:
                frame = raw.recv()
                assert isinstance(frame, Outputs)
                if frame.deltas:            # empty ones: the quiet client checked on
                    frames.append(frame)
            tokens = [t for f in frames for d in f.deltas for t in d.token_ids]
            assert len(tokens) == GREEDY.max_tokens
            assert len(frames) == (GREEDY.max_tokens if stream else 1)
    finally:
        raw.close()
    assert_idle(llm)
