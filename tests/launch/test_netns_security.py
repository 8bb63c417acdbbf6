"""Encrypted sockets beyond loopback, seen from the wire: a server on one test host, a client
on another, and a packet capture on the client host's interface. With CURVE (--curve-keys) the
prompt's token ids and the auth token never appear in the captured ZeroMQ traffic; without it
they do (so the test can fail)."""
from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
from netns_tools.netns import NamespaceHosts, namespaces_unavailable
from spmd_runtime.protocol.curve import make_job_keys

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None,
                                reason=f"no test hosts: {namespaces_unavailable()}")

PROMPT_IDS = [1717, 1718, 1719, 1720, 1721, 1722, 1723, 1724]
TOKEN = "wire-visible-token-7f3a"
CLIENT = """
import sys
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime import Client
address, token, key, ids = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
with Client(address, auth_token=token, server_key=key, timeout_s=120) as client:
    client.wait_ready(300)
    prompt = [int(t) for t in ids.split(",")]
    output = client.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    print("tokens", output.token_ids, flush=True)
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("encrypted", [True, False], ids=["curve", "plain"])
def test_prompt_ids_on_the_wire_only_without_curve(tmp_path, encrypted) -> None:
    keys = tmp_path / "keys"
    if encrypted:
        make_job_keys(keys)
    with NamespaceHosts(2) as hosts:
        rpc = f"tcp://{hosts.addresses[0]}:7000"
        security = ["--curve-keys", str(keys)] if encrypted else []
        log = open(tmp_path / "server.log", "w+")
        hosts.popen(0, [sys.executable, "-m", "spmd_runtime.launch", "serve", "--model",
                        "dummy:tiny-llama", "--rpc-address", rpc, "--allow-remote", *security],
                    env=dict(os.environ, SPMD_API_KEY=TOKEN), stdout=log, stderr=log,
                    stdin=subprocess.DEVNULL)
        try:
            with hosts.capture(1, tmp_path / "wire.bin") as captured:
                client = hosts.run(1, [sys.executable, "-c", CLIENT, rpc, TOKEN,
                                       str(keys / "job.key") if encrypted else "",
                                       ",".join(map(str, PROMPT_IDS))],
                                   capture_output=True, text=True, timeout=400,
                                   stdin=subprocess.DEVNULL)
            wire = captured()
        finally:
            log.seek(0)
            server_log = log.read()
            log.close()
        assert client.returncode == 0, client.stderr[-3000:] + server_log[-3000:]
        assert "tokens [" in client.stdout
    needle = msgspec.msgpack.encode(PROMPT_IDS)
    assert len(wire) > 2000, "the capture saw (almost) no traffic"
    assert (needle in wire) is not encrypted
    assert (TOKEN.encode() in wire) is not encrypted
