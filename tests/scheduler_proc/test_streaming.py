"""stream_update with no processes: a request sent with stream=False gets its whole output in
one delta when it ends, and its client, quiet meanwhile, an empty frame every CHECK_S (a gone
client is found by that send failing)."""
from __future__ import annotations

from spmd_runtime.protocol.messages import Outputs
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.scheduler_proc.request import FinishReason, Request
from spmd_runtime.scheduler_proc.scheduler import StepUpdate
from spmd_runtime.scheduler_proc.streaming import QuietClients, stream_update


class Front:
    """RpcFront's reply: records frames; clients in `gone` cannot be reached."""

    def __init__(self) -> None:
        self.frames: list[tuple[bytes, Outputs]] = []
        self.gone: set[bytes] = set()

    def reply(self, client: bytes, message: Outputs) -> bool:
        if client in self.gone:
            return False
        self.frames.append((client, message))
        return True


class Texts:
    """ServedTokenizer.text: each token's text is its id and a space."""

    def text(self, request_id: int, token_ids: list[int], final: bool) -> tuple[str, bool]:
        return "".join(f"{t} " for t in token_ids), False


def request(request_id: int, client: bytes, stream: bool) -> Request:
    r = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=3), client)
    r.stream = stream
    r.queue_time_s = 0.25
    return r


def step(front, quiet, requests, token: int, finished: bool = False):
    for r in requests:
        r.output_token_ids.append(token)
        if finished:
            r.finish_reason = FinishReason.LENGTH
    update = StepUpdate(finished=list(requests)) if finished else StepUpdate(progressed=list(requests))
    return stream_update(front, Texts(), update, quiet)


def test_a_request_without_stream_gets_its_output_in_one_delta_when_it_ends() -> None:
    front, quiet = Front(), QuietClients(clock=lambda: 0.0)
    streamed, whole = request(1, b"a", stream=True), request(2, b"b", stream=False)
    step(front, quiet, [streamed, whole], 11)
    step(front, quiet, [streamed, whole], 12)
    assert [client for client, _ in front.frames] == [b"a", b"a"]     # b hears nothing yet
    assert step(front, quiet, [streamed, whole], 13, finished=True) == ([], [])
    (client, last), = [f for f in front.frames if f[0] == b"b"]
    (delta,) = last.deltas
    assert delta.request_id == 2 and delta.token_ids == [11, 12, 13] and delta.text == "11 12 13 "
    assert delta.finish_reason == "length" and delta.queue_time_s == 0.25
    deltas_a = [d for c, f in front.frames if c == b"a" for d in f.deltas]
    assert [d.token_ids for d in deltas_a] == [[11], [12], [13]]
    assert deltas_a[0].queue_time_s == 0.25 and deltas_a[1].queue_time_s is None


def test_a_quiet_client_gets_an_empty_frame_every_check_and_a_gone_one_is_reported() -> None:
    now = [0.0]
    front, quiet = Front(), QuietClients(clock=lambda: now[0])
    whole = request(2, b"b", stream=False)
    step(front, quiet, [whole], 11)                       # quiet from t = 0
    now[0] = QuietClients.CHECK_S / 2
    step(front, quiet, [whole], 12)
    assert front.frames == []
    now[0] = QuietClients.CHECK_S
    step(front, quiet, [whole], 13)
    assert front.frames == [(b"b", Outputs(deltas=[]))]
    now[0] = 1.5 * QuietClients.CHECK_S                   # checked at CHECK_S: not due again
    step(front, quiet, [whole], 14)
    assert len(front.frames) == 1
    front.gone.add(b"b")
    now[0] = 2 * QuietClients.CHECK_S
    assert step(front, quiet, [whole], 15) == ([b"b"], [])


def test_a_client_with_a_streamed_request_is_not_checked_on() -> None:
    now = [0.0]
    front, quiet = Front(), QuietClients(clock=lambda: now[0])
    streamed, whole = request(1, b"a", stream=True), request(2, b"a", stream=False)
    for token in range(5):
        now[0] = token * QuietClients.CHECK_S
        step(front, quiet, [streamed, whole], token)
    assert all(f.deltas for _, f in front.frames) and len(front.frames) == 5
