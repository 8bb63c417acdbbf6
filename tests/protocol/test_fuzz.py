"""Property-based fuzzing of every protocol decoder: whatever bytes arrive, decoding returns a
message of its union or raises one of DECODE_ERRORS (which the scheduler answers with an error
reply), never anything else, and never hangs. 12,000 generated inputs in all."""
from __future__ import annotations

import typing

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spmd_runtime.protocol.messages import DECODE_ERRORS
from spmd_runtime.scheduler_proc.rpc_front import _tag_of
from test_messages import UNIONS, auto_sample

FUZZ = settings(max_examples=1000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# msgpack-shaped values: what a confused or hostile client could send that is valid msgpack.
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True) | st.text(max_size=12) | st.binary(max_size=12)
           | st.sampled_from(["add", "abort", "stats", "plan", "result", "ping", "admin_batch"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=30)
SAMPLES = [msgspec.msgpack.encode(auto_sample(cls))
           for union, _ in UNIONS for cls in typing.get_args(union)]


def check(payload: bytes) -> None:
    for union, make_decoder in UNIONS:
        try:
            message = make_decoder().decode(payload)
        except DECODE_ERRORS:
            pass
        else:
            assert isinstance(message, typing.get_args(union))
    tag = _tag_of(payload)
    assert tag is None or isinstance(tag, int)


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes(payload: bytes) -> None:
    check(payload)


@FUZZ
@given(VALUES)
def test_random_msgpack_values(value) -> None:
    check(msgspec.msgpack.encode(value))


@FUZZ
@given(st.sampled_from(["add", "abort", "stats", "reset_prefix_cache", "model_info", "ping",
                        "admin_batch", "plan", "result", "ready", "shutdown", "heartbeat"]),
       st.lists(VALUES, max_size=9))
def test_known_tags_with_random_fields(tag: str, fields: list) -> None:
    check(msgspec.msgpack.encode([tag, *fields]))


@FUZZ
@given(st.sampled_from(SAMPLES), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                          min_size=1, max_size=4))
def test_valid_messages_with_flipped_bytes(sample: bytes, flips: list) -> None:
    data = bytearray(sample)
    for position, value in flips:
        data[position % len(data)] = value
    check(bytes(data))


@FUZZ
@given(st.sampled_from(SAMPLES), st.integers(0, 10_000))
def test_truncated_valid_messages(sample: bytes, cut: int) -> None:
    check(sample[:cut % len(sample)])


@FUZZ
@given(st.sampled_from(SAMPLES), st.binary(min_size=1, max_size=64))
def test_valid_messages_with_trailing_bytes(sample: bytes, tail: bytes) -> None:
    check(sample + tail)


@FUZZ
@given(st.integers(1, 200_000), st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdd\x00\x00\x00\x01"]))
def test_deep_nesting(depth: int, opener: bytes) -> None:
    check(opener * depth + b"\x00")


@FUZZ
@given(st.sampled_from([b"\xdd", b"\xdf", b"\xc6", b"\xdb"]), st.binary(min_size=4, max_size=8))
def test_huge_declared_lengths(marker: bytes, length: bytes) -> None:
    """Containers and strings claiming up to 4 G elements in a few bytes: no giant allocation."""
    check(marker + length)


@settings(max_examples=4000, deadline=None, database=None)
@given(st.binary(max_size=64))
def test_short_random_bytes(payload: bytes) -> None:
    check(payload)
