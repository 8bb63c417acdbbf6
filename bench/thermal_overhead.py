"""Per-step cost of the thermal sensor reading and its MAX all-reduce across the TP group.

Part 1 (always): --tp ranks over gloo, each with the worker's ThermalMonitor on --sensor.
Prints each rank's first reading, then the median per-step time of
  * the sensor read alone,
  * read + all-reduce with nothing to hide behind (the monitor's full cost),
  * what the step loop waits for when the monitor runs beside a forward pass of
    --forward-ms (the cost left on the critical path).
Part 2 (--engine): output tok/s of an engine with --thermal-sensor none and with the given
sensor, alternating, in the same run.

    python bench/thermal_overhead.py --sensor file:/tmp/temp{rank}
    python bench/thermal_overhead.py --sensor nvml --tp 1          # on a GPU node
    python bench/thermal_overhead.py --sensor file:/tmp/temp{rank} --engine --engine-tp 3
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spmd_runtime.worker_proc.thermal import ThermalMonitor


def busy(ms: float) -> None:
    """Stand-in for a forward pass: the main thread computes for `ms`."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + ms / 1e3
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


def worker(rank: int, size: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or size) // size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    device = torch.device("cuda", rank) if args.sensor == "nvml" else torch.device("cpu")
    monitor = ThermalMonitor.create(args.sensor, 1, rank, size, device)
    try:
        first = monitor.sensor.read()
        results.put(("reading", rank, monitor.sensor.kind,
                     first.describe() if first else "no reading"))
        read, full, exposed = [], [], []
        for step in range(args.steps):
            started = time.perf_counter()
            monitor.sensor.read()
            read.append(time.perf_counter() - started)
            dist.barrier()
            started = time.perf_counter()
            monitor.finish(monitor.begin(step))
            full.append(time.perf_counter() - started)
            dist.barrier()
            pending = monitor.begin(step)
            busy(args.forward_ms)
            started = time.perf_counter()
            monitor.finish(pending)
            exposed.append(time.perf_counter() - started)
        if rank == 0:
            results.put(("times", statistics.median(read), statistics.median(full),
                         statistics.median(exposed)))
    finally:
        monitor.close()
        dist.destroy_process_group()


def engine_runs(args: argparse.Namespace) -> None:
    from spmd_runtime.runtime import LLM, SamplingParams
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(32, 129, (args.num_requests,), generator=g)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {"none": [], args.sensor: []}
    for round_index in range(args.rounds):
        order = ["none", args.sensor] if round_index % 2 == 0 else [args.sensor, "none"]
        for sensor in order:
            with LLM(args.model, nproc_per_node=args.engine_tp, thermal_sensor=sensor,
                     num_kv_blocks=512, max_model_len=512) as llm:
                llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
                started = time.perf_counter()
                llm.generate(prompts, params)
                elapsed = time.perf_counter() - started
            rates[sensor].append(args.num_requests * args.output_len / elapsed)
            print(f"  round {round_index + 1} sensor {sensor}: "
                  f"{rates[sensor][-1]:.1f} out tok/s", flush=True)
    none, sensed = statistics.median(rates["none"]), statistics.median(rates[args.sensor])
    print(f"engine {args.model} TP={args.engine_tp}: thermal_sensor none {none:.1f} out tok/s, "
          f"{args.sensor} {sensed:.1f} out tok/s, ratio {sensed / none:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sensor", default="file:/tmp/spmd-thermal-bench-{rank}")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--forward-ms", type=float, default=5.0)
    parser.add_argument("--engine", action="store_true", help="also run part 2")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--engine-tp", type=int, default=3,
                        help="workers of the engine runs (smollm2's 9 heads: 1 or 3)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.sensor.startswith("file:"):
        for rank in range(max(args.tp, args.engine_tp)):
            path = Path(args.sensor[5:].replace("{rank}", str(rank)))
            if not path.exists():
                path.write_text(f"{60 + 5 * rank}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args.tp, port, args, results), nprocs=args.tp, join=True)
    lines = []
    while not results.empty():
        lines.append(results.get())
    for kind, *rest in sorted(lines, key=str):
        if kind == "reading":
            rank, sensor, text = rest
            print(f"rank {rank} sensor {sensor}: {text}")
        else:
            read, full, exposed = rest
            print(f"TP={args.tp} sensor {args.sensor}, {args.steps} steps, medians: read "
                  f"{read * 1e6:.1f} us; read + all-reduce {full * 1e6:.1f} us; left on the "
                  f"critical path beside a {args.forward_ms:.0f} ms forward: {exposed * 1e6:.1f} us")
    if args.engine:
        engine_runs(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
