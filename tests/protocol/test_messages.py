"""Wire types: every message survives its decoder, SamplingParams is validated, plans are compact."""
from __future__ import annotations

import math
import typing

import msgspec
import pytest
from spmd_runtime.protocol.messages import (
    AbortDone,
    AbortRequest,
    AddRequest,
    ClientMessage,
    ErrorReply,
    ModelInfo,
    ModelInfoRequest,
    NewRequestData,
    Outputs,
    RequestAccepted,
    RequestDelta,
    SchedulerToWorker,
    ServerMessage,
    Shutdown,
    StatsRequest,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerReady,
    WorkerToScheduler,
    client_decoder,
    scheduler_inbound_decoder,
    server_decoder,
    worker_inbound_decoder,
)
from spmd_runtime.protocol.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3,
                        stop_token_ids=(5, 9), ignore_eos=True, cache_salt="salt")

CLIENT_MESSAGES = [
    AddRequest(tag=1, prompt_token_ids=[1, 2, 3]),
    AddRequest(tag=2, prompt_token_ids=[4], params=PARAMS, request_id=77),
    AbortRequest(tag=3, request_id=77),
    StatsRequest(tag=4),
    ModelInfoRequest(tag=5),
]

SERVER_MESSAGES = [
    RequestAccepted(tag=1, request_id=0),
    Outputs(deltas=[RequestDelta(0, [1, 2]), RequestDelta(1, [], "abort"),
                    RequestDelta(2, [7], "stop")]),
    Outputs(deltas=[]),
    AbortDone(tag=3, request_id=77),
    ModelInfo(tag=5, model="smollm2", max_model_len=8192, vocab_size=49152, eos_token_ids=[2],
              block_size=16, world_size=1),
    ErrorReply(tag=None, message="invalid request: garbage"),
    ErrorReply(tag=6, message="prompt is empty", request_id=4),
]

TO_WORKER_MESSAGES = [
    StepPlan(step_id=0, new_requests=[NewRequestData(3, [1, 2, 3, 4], [5, 9], 0, 4, PARAMS)],
             cached_request_ids=[1, 2], cached_num_scheduled_tokens=[1, 16],
             cached_new_block_ids=[[], [11, 12]], dropped_request_ids=[0]),
    StepPlan(step_id=-1, new_requests=[], cached_request_ids=[], cached_num_scheduled_tokens=[],
             cached_new_block_ids=[], dropped_request_ids=[4, 5]),
    Shutdown(),
    Shutdown(reason="scheduler stopping"),
]

FROM_WORKER_MESSAGES = [
    WorkerReady(rank=0, num_kv_blocks=100, max_model_len=2048, vocab_size=512,
                eos_token_ids=[2, 7], device="cpu"),
    StepResult(step_id=4, request_ids=[1, 2], sampled_token_ids=[10, 11], forward_ms=1.5,
               prepare_ms=0.25),
    WorkerError(rank=1, message="Traceback ..."),
]


def auto_sample(cls: type, seed: int = 0):
    """An instance of a message type with every field filled from its type (defaults too)."""
    info = msgspec.inspect.type_info(cls)
    values = {}
    for i, field in enumerate(info.fields):
        values[field.name] = _value_for(field.type, seed + i)
    return cls(**values)


def _value_for(kind, n: int):
    inspect = msgspec.inspect
    if isinstance(kind, inspect.Metadata):
        kind = kind.type
    if isinstance(kind, inspect.UnionType):
        kind = next(t for t in kind.types if not isinstance(t, inspect.NoneType))
    if isinstance(kind, inspect.LiteralType):
        return kind.values[n % len(kind.values)]
    if isinstance(kind, inspect.BoolType):
        return bool(n % 2)
    if isinstance(kind, inspect.IntType):
        return n + 1
    if isinstance(kind, inspect.FloatType):
        return n + 0.5
    if isinstance(kind, inspect.StrType):
        return f"s{n}"
    if isinstance(kind, inspect.BytesType):
        return b"b"
    if isinstance(kind, (inspect.ListType, inspect.VarTupleType)):
        item = _value_for(kind.item_type, n)
        return [item, item] if isinstance(kind, inspect.ListType) else (item,)
    if isinstance(kind, inspect.TupleType):
        return tuple(_value_for(item, n + i) for i, item in enumerate(kind.item_types))
    if isinstance(kind, inspect.DictType):
        return {_value_for(kind.key_type, n): _value_for(kind.value_type, n)}
    if isinstance(kind, (inspect.StructType, inspect.DataclassType, inspect.NamedTupleType)):
        if kind.cls is SamplingParams:
            return PARAMS
        return auto_sample(kind.cls, n)
    if isinstance(kind, inspect.EnumType):
        members = list(kind.cls)
        return members[n % len(members)]
    raise AssertionError(f"no sample value for {kind}")


UNIONS = [(ClientMessage, client_decoder), (ServerMessage, server_decoder),
          (SchedulerToWorker, worker_inbound_decoder),
          (WorkerToScheduler, scheduler_inbound_decoder)]


@pytest.mark.parametrize(("union", "make_decoder"), UNIONS,
                         ids=["client->scheduler", "scheduler->client", "scheduler->worker",
                              "worker->scheduler"])
def test_every_message_type_round_trips(union, make_decoder) -> None:
    decoder = make_decoder()
    for cls in typing.get_args(union):
        message = auto_sample(cls)
        decoded = decoder.decode(msgspec.msgpack.encode(message))
        assert type(decoded) is cls and decoded == message, cls.__name__


@pytest.mark.parametrize(("messages", "make_decoder"), [
    (CLIENT_MESSAGES, client_decoder),
    (SERVER_MESSAGES, server_decoder),
    (TO_WORKER_MESSAGES, worker_inbound_decoder),
    (FROM_WORKER_MESSAGES, scheduler_inbound_decoder),
], ids=["client->scheduler", "scheduler->client", "scheduler->worker", "worker->scheduler"])
def test_every_message_round_trips_through_its_decoder(messages, make_decoder) -> None:
    decoder = make_decoder()
    encoder = msgspec.msgpack.Encoder()
    for message in messages:
        decoded = decoder.decode(encoder.encode(message))
        assert type(decoded) is type(message)
        assert decoded == message


def test_sampling_params_round_trip_alone() -> None:
    for params in (SamplingParams(), PARAMS, SamplingParams(temperature=0, max_tokens=1)):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_a_message_of_the_wrong_direction_is_rejected() -> None:
    payload = msgspec.msgpack.encode(StepResult(step_id=1, request_ids=[], sampled_token_ids=[],
                                                forward_ms=0.0, prepare_ms=0.0))
    with pytest.raises(msgspec.ValidationError):
        client_decoder().decode(payload)
    with pytest.raises(msgspec.DecodeError):
        client_decoder().decode(b"\xc1 not msgpack at all")


# field name, keyword arguments, positional wire form of SamplingParams (array_like)
INVALID_PARAMS = [
    ("max_tokens", {"max_tokens": 0}, [0]),
    ("max_tokens", {"max_tokens": -3}, [-3]),
    ("temperature", {"temperature": -1.0}, [16, -1.0]),
    ("temperature", {"temperature": math.nan}, [16, math.nan]),
    ("temperature", {"temperature": math.inf}, [16, math.inf]),
    ("top_p", {"top_p": 0.0}, [16, 1.0, 0.0]),
    ("top_p", {"top_p": 1.5}, [16, 1.0, 1.5]),
    ("top_k", {"top_k": 0}, [16, 1.0, 1.0, 0]),
    ("top_k", {"top_k": -2}, [16, 1.0, 1.0, -2]),
    ("stop_token_ids", {"stop_token_ids": (-1,)}, [16, 1.0, 1.0, -1, None, [-1]]),
    ("logprobs", {"logprobs": 21},
     [16, 1.0, 1.0, -1, None, [], False, None, 1.0, 0.0, 0.0, 0.0, [], 21]),
    ("prompt_logprobs", {"prompt_logprobs": -1},
     [16, 1.0, 1.0, -1, None, [], False, None, 1.0, 0.0, 0.0, 0.0, [], None, -1]),
]


@pytest.mark.parametrize(("field", "kwargs", "wire"), INVALID_PARAMS,
                         ids=[f"{f}={list(k.values())[0]}" for f, k, _ in INVALID_PARAMS])
def test_invalid_sampling_params_are_refused_on_construction(field, kwargs, wire) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("field", "kwargs", "wire"), INVALID_PARAMS,
                         ids=[f"{f}={list(k.values())[0]}" for f, k, _ in INVALID_PARAMS])
def test_invalid_sampling_params_are_refused_when_decoded(field, kwargs, wire) -> None:
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=SamplingParams)
    # Also nested in the client's AddRequest, as the scheduler decodes it.
    frame = msgspec.msgpack.encode(["add", 1, [1, 2, 3], wire])
    with pytest.raises(msgspec.ValidationError, match=field):
        client_decoder().decode(frame)
    # ValidationError is a ValueError too.
    with pytest.raises(ValueError):
        client_decoder().decode(frame)


def test_valid_edge_sampling_params() -> None:
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1)
    SamplingParams(top_k=1, top_p=1e-9, seed=0)
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.1).greedy


def test_plan_is_compact_for_decodes() -> None:
    """256 running decode requests cost a few bytes each per step (ids, 1 token, no new block)."""
    n = 256
    plan = StepPlan(step_id=123_456, new_requests=[],
                    cached_request_ids=list(range(10_000, 10_000 + n)),
                    cached_num_scheduled_tokens=[1] * n, cached_new_block_ids=[[]] * n)
    payload = msgspec.msgpack.encode(plan)
    assert len(payload) / n < 8, f"{len(payload)} bytes for {n} decodes"
    assert worker_inbound_decoder().decode(payload) == plan


def test_new_request_carries_params_once_and_decodes_equal() -> None:
    new = NewRequestData(request_id=1, token_ids=list(range(100)), block_ids=list(range(7)),
                         num_computed_tokens=0, num_scheduled_tokens=100, params=PARAMS)
    plan = StepPlan(step_id=0, new_requests=[new], cached_request_ids=[],
                    cached_num_scheduled_tokens=[], cached_new_block_ids=[])
    decoded = worker_inbound_decoder().decode(msgspec.msgpack.encode(plan))
    assert decoded.new_requests[0].params == PARAMS
    assert decoded.new_requests[0].token_ids == list(range(100))
