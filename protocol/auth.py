"""The auth token on the wire: whoever sends to the scheduler's sockets (clients, workers,
launchers) puts the --auth-token in a frame before the payload, and the scheduler checks it,
in constant time, before it decodes anything."""
from __future__ import annotations

import hmac
from collections.abc import Sequence


class AuthRejected(ValueError):
    """A received message without the right auth token, or in no shape a sender makes."""


def framed(token: str, payload: bytes) -> list[bytes]:
    """The frames that carry `payload`: [token, payload] with an auth token, [payload]
    without one ('')."""
    return [token.encode(), payload] if token else [payload]


def checked_payload(frames: Sequence[bytes], token: str) -> bytes:
    """The payload of the frames a sender sent (a ROUTER's, less the identity) when they carry
    `token` ('': no token at all); AuthRejected, saying what is wrong, otherwise."""
    if token and len(frames) == 2:
        if hmac.compare_digest(frames[0], token.encode()):
            return frames[1]
        raise AuthRejected("the message's auth token is wrong")
    if token and len(frames) == 1:
        raise AuthRejected("the message carries no auth token, and this server requires one "
                           "on every message")
    if not token and frames:
        # Without a token the payload is the last frame; a token sent anyway is ignored, as
        # it always was (a client configured with one still reaches a server without).
        return frames[-1]
    raise AuthRejected(f"a message is its payload, after the auth token when the server has "
                       f"one; got {len(frames)} frames")
