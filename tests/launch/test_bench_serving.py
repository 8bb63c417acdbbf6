"""`spmdrun bench serving`: arrival schedules, the report's arithmetic, and real runs against a
server's HTTP front and RPC endpoint (one server for the module, smollm2, short requests)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import repo_pythonpath
from spmd_runtime.launch.bench_serving import RequestResult, ServingReport, arrival_offsets

REPO_ROOT = Path(__file__).resolve().parents[2]
AUTH_TOKEN = "bench-rpc-secret"


def test_all_at_once_and_poisson_arrivals() -> None:
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    offsets = arrival_offsets(2000, 10.0, 7)
    assert offsets == arrival_offsets(2000, 10.0, 7), "the schedule is reproducible by seed"
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    # Exponential gaps of mean 1/rate: the sample mean of 1999 gaps is within a few percent.
    assert 0.09 < sum(gaps) / len(gaps) < 0.11
    assert min(gaps) < 0.01 < 0.3 < max(gaps), "gaps spread like an exponential, not a grid"


def test_report_figures() -> None:
    results = [RequestResult(prompt_tokens=10, output_tokens=5, ttft_s=0.2, latency_s=0.6,
                             token_gaps_s=[0.1] * 4),
               RequestResult(prompt_tokens=20, output_tokens=3, ttft_s=0.4, latency_s=0.8,
                             token_gaps_s=[0.2, 0.2]),
               RequestResult(prompt_tokens=7, error="RuntimeError('boom')")]
    report = ServingReport("RPC test", math.inf, results, duration_s=2.0)
    s = report.summary()
    assert s["successful_requests"] == 2 and s["failed_requests"] == 1
    assert s["input_tokens"] == 30 and s["output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["ttft_ms"] == pytest.approx((300.0, 300.0, 400.0))
    assert s["tpot_ms"] == pytest.approx((150.0, 150.0, 200.0))
    assert s["itl_ms"][0] == pytest.approx(1000 * 0.8 / 6)
    table = report.table()
    for label in ("successful requests", "request throughput", "output token throughput",
                  "time to first token", "time per output token", "inter-token latency",
                  "first failure: RuntimeError('boom')"):
        assert label in table


@pytest.fixture(scope="module")
def server(spmd_serve, free_port):
    port = free_port()
    srv = spmd_serve("--model", "smollm2", "--max-model-len", "128", "--http-port", str(port),
                     "--auth-token", AUTH_TOKEN)
    srv.base_url = f"http://127.0.0.1:{port}"
    with srv.serving():
        yield srv


def bench(*args: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_pythonpath(env)
    result = subprocess.run([sys.executable, "-m", "spmd_runtime.launch", "bench", "serving", *args,
                             "--json"],
                            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("serving benchmark:")
    assert any(line.startswith("time to first token") for line in lines)
    # Not a terminal: progress goes to the log as plain lines, never into the table.
    assert "bench serving: 6/6 done" in result.stderr
    return json.loads(lines[-1])


WORKLOAD = ("--num-requests", "6", "--input-len-min", "8", "--input-len-max", "24",
            "--output-len", "5")


@pytest.mark.timeout(400)
def test_bench_against_the_http_front(server) -> None:
    summary = bench("--url", server.base_url, "--auth-token", AUTH_TOKEN, *WORKLOAD)
    assert summary["successful_requests"] == 6 and summary["failed_requests"] == 0
    assert summary["output_tokens"] == 6 * 5
    assert 6 * 8 <= summary["input_tokens"] <= 6 * 24
    assert summary["ttft_ms"][0] > 0 and summary["tpot_ms"][0] > 0 and summary["itl_ms"][0] > 0


@pytest.mark.timeout(400)
def test_bench_against_the_rpc_endpoint_at_a_rate(server) -> None:
    summary = bench("--url", server.address, "--auth-token", AUTH_TOKEN, "--request-rate", "20",
                    "--dataset", "shared-prefix",
                    "--num-prefixes", "2", "--prefix-len", "16", "--suffix-len", "4", *WORKLOAD)
    assert summary["successful_requests"] == 6 and summary["failed_requests"] == 0
    assert summary["output_tokens"] == 6 * 5
    assert summary["input_tokens"] == 6 * 20
    assert summary["ttft_ms"][0] > 0 and summary["tpot_ms"][0] > 0


@pytest.mark.timeout(200)
def test_bench_without_the_servers_auth_token_says_so(server) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_pythonpath(env)
    result = subprocess.run([sys.executable, "-m", "spmd_runtime.launch", "bench", "serving", "--url",
                             server.address, *WORKLOAD], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=150)
    assert result.returncode == 1
    assert "auth token" in result.stderr and "serving benchmark" not in result.stdout
