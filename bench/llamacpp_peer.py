"""llama.cpp's server as a peer of bench/cpu_peers.py: starts llama-server on the float32 GGUF
of bench/setup_llama_cpp.sh, runs a spec (see peer_common) through its /completion endpoint,
and stops it, always.

    python bench/llamacpp_peer.py SPEC.json RESULT.json [--dir ~/.cache/spmd-bench/llama.cpp]

The server gets one slot per request of the largest run (at most the spec's max_num_seqs), a
context of slots x the longest prompt plus output, a float32 KV cache (as ours and vLLM's), and
os.cpu_count() threads. Each request sends the prompt as token ids, greedy (top-k 1,
temperature 0), EOS ignored, no prompt cache; a throughput run sends all at once, one thread
each.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peer_common import Generate, longest_request, read_json, run_spec, write_json

ENGINE = "llama.cpp server"
DEFAULT_DIR = Path.home() / ".cache" / "spmd-bench" / "llama.cpp"
STARTUP_TIMEOUT_S = 300.0


def llama_cpp_files(cache_dir: Path = DEFAULT_DIR, gguf: Path | None = None
                    ) -> tuple[Path, Path] | None:
    """(llama-server, the GGUF: `gguf`, else the float32 one) as bench/setup_llama_cpp.sh leaves
    them, or None."""
    server = cache_dir / "build" / "bin" / "llama-server"
    gguf = gguf or cache_dir / "smollm2-f32.gguf"
    return (server, gguf) if server.is_file() and gguf.is_file() else None


def server_shape(spec: dict) -> tuple[int, int]:
    """(slots, context tokens): a slot per concurrent request, each holding its longest one."""
    runs = spec["runs"]
    slots = min(spec["max_num_seqs"], max(len(r["prompts"]) if r["mode"] == "throughput" else 1
                                           for r in runs))
    per_slot = -(-(longest_request(runs) + 16) // 256) * 256
    return slots, slots * per_slot


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(server: Path, gguf: Path, slots: int, context: int, log,
                 threads: int | None = None) -> tuple[subprocess.Popen, str]:
    """llama-server on a free loopback port, once /health answers; (process, base URL)."""
    port, threads = _free_port(), threads or os.cpu_count() or 1
    process = subprocess.Popen(
        [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
         "-np", str(slots), "-c", str(context), "-t", str(threads), "-tb", str(threads),
         "--cache-type-k", "f32", "--cache-type-v", "f32", "--no-webui"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
    except BaseException:
        stop_server(process)
        raise
    return process, url


def _wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.5)
    raise TimeoutError(f"llama-server not healthy after {STARTUP_TIMEOUT_S:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def complete(url: str, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """One /completion request: greedy, EOS ignored, no prompt cache; the generated token ids."""
    body = {"prompt": list(prompt), "n_predict": max_tokens, "ignore_eos": True,
            "cache_prompt": False, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
            "return_tokens": True}
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.load(response)["tokens"]


def server_generate(url: str) -> Generate:
    def generate(prompts: Sequence[Sequence[int]], output_lens: Sequence[int]) -> list[list[int]]:
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(lambda p, n: complete(url, p, n), prompts, output_lens))

    return generate


def run_llamacpp(spec: dict, cache_dir: Path = DEFAULT_DIR, threads: int | None = None,
                 gguf: Path | None = None) -> dict:
    """Start the server on `gguf` (default: the float32 SmolLM2) (not timed, reported as
    startup_s), run the spec, stop it."""
    files = llama_cpp_files(cache_dir, gguf)
    if files is None:
        raise FileNotFoundError(f"no llama-server under {cache_dir} or no {gguf or 'smollm2-f32.gguf'}:"
                                " run bench/setup_llama_cpp.sh")
    slots, context = server_shape(spec)
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        try:
            process, url = start_server(*files, slots, context, log, threads)
        except (RuntimeError, TimeoutError):
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
        startup_s = time.perf_counter() - started
        try:
            results = run_spec(ENGINE, spec["runs"], server_generate(url))
        finally:
            stop_server(process)
    return {"engine": ENGINE, "startup_s": startup_s, "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("result")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help="bench/setup_llama_cpp.sh's cache directory (default: %(default)s)")
    args = parser.parse_args()
    write_json(args.result, run_llamacpp(read_json(args.spec), args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
