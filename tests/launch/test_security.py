"""A server with --auth-token: clients without it (or with a wrong one) are refused on every
message, workers' frames carry it too (TP=2), pickled frames are never unpickled, and admin
calls need the admin token besides."""
from __future__ import annotations

import pickle
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import psutil
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
                     "--auth-token", TOKEN, "--enable-admin", "--admin-token", "adm1n", "--device", "cpu",
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


# ---------------------------------------------------------------------------- secrets in argv

ENV_TOKEN, ENV_ADMIN = "env-auth-7f3a9c", "env-admin-51bd2e"


def cmdlines(procs) -> dict[int, str]:
    """Each process's /proc/<pid>/cmdline: what every user of the machine can read (ps)."""
    return {proc.pid: Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
            for proc in procs}


@pytest.mark.timeout(240)
def test_tokens_from_the_environment_are_in_no_command_line(spmd_serve, free_port,
                                                             monkeypatch) -> None:
    """Launcher, scheduler, worker and HTTP front: the tokens reach every one (they are
    enforced) without appearing in any argv or in the logs."""
    monkeypatch.setenv("SPMD_API_KEY", ENV_TOKEN)
    monkeypatch.setenv("SPMD_ADMIN_TOKEN", ENV_ADMIN)
    port = free_port()
    server = spmd_serve("--model", "dummy:tiny-llama", "--http-port", str(port), "--enable-admin")
    with server.serving():
        deadline = time.monotonic() + 60
        while "HTTP front" not in server.stdout:
            assert time.monotonic() < deadline, server.stderr[-3000:]
            time.sleep(0.1)
        procs = server.processes()
        lines = cmdlines(procs)
        assert len(lines) == 4, lines          # launcher, scheduler, worker, HTTP front
        for pid, line in lines.items():
            assert ENV_TOKEN not in line and ENV_ADMIN not in line, (pid, line)
            assert "{" not in line, f"a config in the command line of {pid}: {line}"
        with Client(server.address, auth_token="", timeout_s=20) as client:
            with pytest.raises(PermissionError, match="auth token"):
                client.stats()
        with Client(server.address, auth_token=ENV_TOKEN, admin_token=ENV_ADMIN,
                    timeout_s=60) as client:
            assert client.stats().kv_blocks_total > 0
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=20)
        request.add_header("Authorization", f"Bearer {ENV_TOKEN}")
        with urllib.request.urlopen(request, timeout=20) as reply:
            assert reply.status == 200
    logs = server.stdout + server.stderr
    assert ENV_TOKEN not in logs and ENV_ADMIN not in logs


@pytest.mark.timeout(240)
def test_the_launcher_started_by_llm_gets_its_config_outside_its_command_line() -> None:
    from spmd_runtime.runtime import LLM

    with LLM("dummy:tiny-llama", auth_token=ENV_TOKEN, enable_admin=True, admin_token=ENV_ADMIN,
             kv_cache_memory="16MiB") as llm:
        launcher = psutil.Process(llm._process.pid)
        procs = [launcher, *launcher.children(recursive=True)]
        lines = cmdlines(procs)
        assert len(lines) == 3, lines          # launcher, scheduler, worker
        for pid, line in lines.items():
            assert ENV_TOKEN not in line and ENV_ADMIN not in line, (pid, line)
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0,
                                                          ignore_eos=True))
        assert len(out.token_ids) == 2
