"""Job keys for CURVE (protocol/curve.py): made once, loaded from a directory, a file or the key
itself, refused with a message saying what to do; and a client with a wrong or missing key is
told so (runtime/rpc.py HandshakeWatch) instead of waiting on a silent engine."""
from __future__ import annotations

import os
import stat

import pytest
import zmq
from spmd_runtime.protocol.curve import CurveKeyError, load_keys, make_job_keys
from spmd_runtime.protocol.transport import make_socket
from spmd_runtime.runtime.client import Client
from spmd_runtime.runtime.rpc import EngineError


def test_make_and_load_job_keys(tmp_path) -> None:
    public_file, secret_file = make_job_keys(tmp_path / "keys")
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    both = load_keys(tmp_path / "keys", need_secret=True)
    assert both.secret is not None and len(both.public) == 40
    public = load_keys(public_file, need_secret=False)
    assert public.public == both.public and public.secret is None
    assert load_keys(both.public.decode(), need_secret=False).public == both.public
    assert "secret" not in public_file.read_text().replace("keep it secret", "")
    with pytest.raises(CurveKeyError, match="already holds job keys"):
        make_job_keys(tmp_path / "keys")
    with pytest.raises(CurveKeyError, match="needs job.key_secret"):
        load_keys(public_file, need_secret=True)
    with pytest.raises(CurveKeyError, match="spmdrun keys"):
        load_keys(tmp_path / "nowhere", need_secret=False)
    (tmp_path / "bad.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(CurveKeyError, match="malformed"):
        load_keys(tmp_path / "bad.key", need_secret=False)


@pytest.mark.parametrize("given", ["wrong", "none"])
def test_a_client_with_a_wrong_or_no_key_is_told_why(tmp_path, given) -> None:
    make_job_keys(tmp_path / "job")
    make_job_keys(tmp_path / "other")
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", bind=True,
                         curve=load_keys(tmp_path / "job", need_secret=True))
    address = server.getsockopt_string(zmq.LAST_ENDPOINT)
    key = str(tmp_path / "other" / "job.key") if given == "wrong" else ""
    client = Client(address, timeout_s=60.0, server_key=key)
    try:
        with pytest.raises(EngineError, match="server_key" if given == "none" else
                           "refused the encrypted handshake") as raised:
            client.model_info()
        assert raised.value.kind == "handshake"
    finally:
        client.close()
        server.close(linger=0)
        ctx.term()


def test_the_right_key_encrypts_and_talks(tmp_path) -> None:
    make_job_keys(tmp_path / "job")
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", bind=True,
                         curve=load_keys(tmp_path / "job", need_secret=True))
    address = server.getsockopt_string(zmq.LAST_ENDPOINT)
    client = make_socket(ctx, zmq.DEALER, address, bind=False,
                         curve=load_keys(tmp_path / "job" / "job.key", need_secret=False))
    try:
        client.send(b"hello")
        assert server.poll(10_000)
        assert server.recv_multipart()[1] == b"hello"
    finally:
        client.close(linger=0)
        server.close(linger=0)
        ctx.term()


def test_spmdrun_keys_and_the_checks_before_start(tmp_path, capsys) -> None:
    from spmd_runtime.launch.cli import main
    from spmd_runtime.protocol.config import EngineConfig
    from spmd_runtime.runtime.preflight import ConfigError, check_curve_keys, security_warnings

    assert main(["keys", str(tmp_path / "job")]) == 0
    assert "job.key_secret" in capsys.readouterr().out
    assert main(["keys", str(tmp_path / "job")]) == 2
    assert "already holds job keys" in capsys.readouterr().err
    remote = dict(rpc_address="tcp://10.1.2.3:7000", allow_remote=True, auth_token="t")
    check_curve_keys(EngineConfig(**remote, curve_keys=str(tmp_path / "job")))
    with pytest.raises(ConfigError, match="--curve-keys: .*needs job.key_secret"):
        check_curve_keys(EngineConfig(**remote, curve_keys=str(tmp_path / "job" / "job.key")))
    # Other nodes only connect: the public key is enough there.
    check_curve_keys(EngineConfig(**remote, node_rank=1, nnodes=2, master_addr="10.1.2.3",
                                  curve_keys=str(tmp_path / "job" / "job.key")))
    with pytest.raises(ConfigError, match="spmdrun keys"):
        check_curve_keys(EngineConfig(curve_keys=str(tmp_path / "none")))
    assert "unencrypted" in security_warnings(EngineConfig(**remote))[0]
    assert security_warnings(EngineConfig(**remote, curve_keys=str(tmp_path / "job"))) == []
    assert security_warnings(EngineConfig()) == []
