"""A server with --auth-token: clients without it (or with a wrong one) are refused on every
message, workers' frames carry it too (TP=2), pickled frames are never unpickled, and admin
calls need the admin token besides."""
from __future__ import annotations

import pickle

import msgspec
import pytest
from raw_socket import RawSocket
from sharp_llama import sharp_llama
from spmd_runtime.protocol.messages import AddRequest, EngineStats, ErrorReply, StatsRequest
from spmd_runtime.runtime import Client, SamplingParams

TOKEN = "auth-s3cret"


@pytest.fixture(scope="module")
def server(spmd_serve, tmp_path_factory):
    model = sharp_llama(tmp_path_factory.mktemp("secure-llama"))[0]
    srv = spmd_serve("--model", model, "--num-kv-blocks", "64", "--max-model-len", "256",
                     "--auth-token", TOKEN, "--admin-token", "adm1n",
                     launcher=["--nproc-per-node", "2"])
    with srv.serving():
        yield srv


@pytest.mark.parametrize("token", ["", "wrong", TOKEN + "x"])
def test_clients_without_the_token_are_refused(server, token) -> None:
    with Client(server.address, auth_token=token, timeout_s=20) as client:
        with pytest.raises(PermissionError, match="auth token"):
            client.stats()
        with pytest.raises(PermissionError, match="auth token"):
            client.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_clients_with_the_token_are_served_by_both_workers(server) -> None:
    with Client(server.address, auth_token=TOKEN, timeout_s=60) as client:
        (out,) = client.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0,
                                                             ignore_eos=True))
        assert len(out.token_ids) == 5
        assert client.model_info().world_size == 2
        with pytest.raises(PermissionError, match="admin token"):
            client.admin_batch(max_num_seqs=2)
        stats = client.stats()
        assert stats.rejected_frames >= 1      # the refused clients of the test above


def test_pickled_frames_are_refused_not_unpickled(server) -> None:
    raw = RawSocket(server.address)
    try:
        request = AddRequest(tag=5, prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2))
        for frame in (pickle.dumps(request), pickle.dumps({"tag": 5, "prompt": [1, 2]})):
            raw.sock.send_multipart([TOKEN.encode(), frame])
            reply = raw.recv()
            assert isinstance(reply, ErrorReply) and reply.message.startswith("invalid request")
            raw.sock.send(frame)                       # and without the token
            reply = raw.recv()
            assert isinstance(reply, ErrorReply) and reply.code == "forbidden"
        raw.sock.send_multipart([TOKEN.encode(), msgspec.msgpack.encode(StatsRequest(tag=8))])
        assert isinstance(raw.recv(), EngineStats)
    finally:
        raw.close()
