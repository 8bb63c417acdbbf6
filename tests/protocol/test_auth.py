"""The auth token on the wire (protocol/auth.py): what senders frame is what the scheduler's
check accepts, the frames are the ones every sender wrote by hand before, and a missing, wrong
or unexpected token is refused with a reason, the token compared in constant time."""
from __future__ import annotations

import hmac

import pytest
import zmq
from spmd_runtime.protocol.auth import AuthRejected, checked_payload, framed

TOKEN = "s3cret-token"
PAYLOAD = b"\x92\xa4ping\x01"


@pytest.mark.parametrize("token", [TOKEN, ""])
def test_framed_payload_passes_the_check(token) -> None:
    assert checked_payload(framed(token, PAYLOAD), token) == PAYLOAD


def test_the_frames_are_the_wire_format() -> None:
    # [token, payload] with an auth token, the bare payload without: older processes agree.
    assert framed(TOKEN, PAYLOAD) == [TOKEN.encode(), PAYLOAD]
    assert framed("", PAYLOAD) == [PAYLOAD]


def test_a_wrong_token_is_refused() -> None:
    for wrong in ("wrong", TOKEN + "x", TOKEN[:-1], ""):
        frames = [wrong.encode(), PAYLOAD]
        with pytest.raises(AuthRejected, match="auth token is wrong"):
            checked_payload(frames, TOKEN)


def test_a_missing_token_is_refused() -> None:
    with pytest.raises(AuthRejected, match="no auth token"):
        checked_payload(framed("", PAYLOAD), TOKEN)


def test_without_a_token_the_payload_is_the_last_frame_whatever_comes_before() -> None:
    """As before the module existed: a client configured with a token still reaches a server
    without one."""
    assert checked_payload(framed(TOKEN, PAYLOAD), "") == PAYLOAD
    assert checked_payload([TOKEN.encode(), b"x", PAYLOAD], "") == PAYLOAD


def test_frames_in_no_sender_shape_are_refused() -> None:
    for frames, token in (([], TOKEN), ([TOKEN.encode(), b"x", PAYLOAD], TOKEN), ([], "")):
        with pytest.raises(AuthRejected, match=f"got {len(frames)} frames"):
            checked_payload(frames, token)


def test_the_token_is_compared_in_constant_time(monkeypatch) -> None:
    compared = []

    def compare_digest(a, b):
        compared.append((a, b))
        return real(a, b)

    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    assert checked_payload(framed(TOKEN, PAYLOAD), TOKEN) == PAYLOAD
    with pytest.raises(AuthRejected):
        checked_payload([b"guess", PAYLOAD], TOKEN)
    assert compared == [(TOKEN.encode(), TOKEN.encode()), (b"guess", TOKEN.encode())]


@pytest.mark.parametrize("token", [TOKEN, ""])
def test_a_router_checks_what_a_dealer_sent(token) -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://auth-test")
        dealer.connect("inproc://auth-test")
        dealer.send_multipart(framed(token, PAYLOAD))
        assert router.poll(5000)
        identity, *sent = router.recv_multipart()
        assert checked_payload(sent, token) == PAYLOAD
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
