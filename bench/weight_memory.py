"""Weight memory per parameter, logged and measured: a worker serving a model in each dtype /
quantization, its `weights` log line and its resident memory (RSS) once it serves.

    python bench/weight_memory.py --model dummy:llama-3.2-1b --configs float32 bfloat16 int8
    python bench/weight_memory.py --model FILE.gguf --configs gguf    # the file's blocks kept

Each config starts `spmdrun serve` afresh with a small KV cache (--kv-cache-memory 64MiB, so RSS
is mostly weights), waits until it serves, reads the worker's RSS and the logged weight bytes,
and stops it. int8 is `--quantization int8` over the resolved --dtype auto. Bytes per parameter
divide by the model's parameter count (embedding table counted once when tied). "above base"
subtracts the RSS of a worker serving dummy:tiny-llama with the same flags (torch, the
runtime, the KV cache: what every worker holds whatever its model). "engine RSS" adds the
scheduler and launcher processes to the workers'. For a GGUF file the parameters are its
tensors' elements and the file's size is printed beside.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from spmd_runtime.protocol.model_config import model_preset, weight_shapes

CONFIGS = {"float32": ["--dtype", "float32"], "bfloat16": ["--dtype", "bfloat16"],
           "auto": ["--dtype", "auto"], "int8": ["--quantization", "int8"],
           "int8-bfloat16": ["--dtype", "bfloat16", "--quantization", "int8"],
           "gguf": ["--dtype", "float32", "--quantization", "gguf"]}


def parameter_count(model: str) -> int:
    if model.endswith(".gguf"):
        from spmd_runtime.runtime.loaders.gguf_file import GGUFFile
        return sum(int(np.prod(t.shape)) for t in GGUFFile(model).tensors)
    shapes = weight_shapes(model_preset(model.removeprefix("dummy:")))
    count = 0
    for shape in shapes.values():
        size = 1
        for dim in shape:
            size *= dim
        count += size
    return count


def measure(model: str, flags: list[str], timeout_s: float = 600.0) -> tuple[float, int, int]:
    """(logged weight GiB, worker RSS bytes, engine RSS bytes) of one serving engine."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "log.txt"
        with open(log_path, "w") as log:
            server = subprocess.Popen([sys.executable, "-m", "spmd_runtime.launch", "serve",
                                       "--model", model, "--kv-cache-memory", "64MiB",
                                       "--skip-warmup", *flags], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + timeout_s
            while "serving on" not in log_path.read_text():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not serve:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
            launcher = psutil.Process(server.pid)
            processes = [launcher, *launcher.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in processes if "worker_proc" in " ".join(p.cmdline()))
            engine = sum(p.memory_info().rss for p in processes)
            logged = float(re.search(r"weights ([\d.]+) GiB", log_path.read_text()).group(1))
        finally:
            server.terminate()
            server.wait(60)
    return logged, rss, engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3.2-1b")
    parser.add_argument("--configs", nargs="+", default=["float32", "bfloat16", "int8"],
                        choices=tuple(CONFIGS))
    args = parser.parse_args()
    params = parameter_count(args.model)
    size = f", file {Path(args.model).stat().st_size / 2**30:.2f} GiB" if args.model.endswith(
        ".gguf") else ""
    print(f"{args.model}: {params / 1e9:.3f} B parameters{size}")
    print(f"{'config':<16}{'logged GiB':>12}{'B/param':>9}{'worker RSS GiB':>16}{'B/param':>9}"
          f"{'above base':>12}{'B/param':>9}{'engine RSS GiB':>16}")
    for name in args.configs:
        logged, rss, engine = measure(args.model, CONFIGS[name])
        above = rss - measure("dummy:tiny-llama", CONFIGS[name if name != "gguf" else "float32"])[1]
        print(f"{name:<16}{logged:>12.2f}{logged * 2**30 / params:>9.2f}{rss / 2**30:>16.2f}"
              f"{rss / params:>9.2f}{above / 2**30:>12.2f}{above / params:>9.2f}"
              f"{engine / 2**30:>16.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
