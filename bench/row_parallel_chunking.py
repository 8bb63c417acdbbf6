"""An isolated row-parallel layer at TP=2 over gloo: single-shot vs chunked (async all-reduce
of each chunk overlapping the next chunk's matmul). Prints the speedup table (baseline time /
chunked time) in the layout of the row-parallel chunking source document.

    python bench/row_parallel_chunking.py --tokens 1024 2048 4096 8192 --chunks 2 4 8 16
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spmd_runtime.runtime.layers.parallel import TensorParallel, row_parallel_linear


def best_of(repeats: int, x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> float:
    """Fastest of `repeats` calls, each started together on every rank (after a warm-up)."""
    row_parallel_linear(x, weight, None, tp)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        row_parallel_linear(x, weight, None, tp)
        times.append(time.perf_counter() - started)
    return min(times)


def worker(rank: int, size: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or size) // size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        weight = torch.randn(args.out_features, args.in_features // size)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.in_features // size)
            baseline = best_of(args.repeats, x, weight, TensorParallel(rank, size))
            for chunks in args.chunks:
                chunked = best_of(args.repeats, x, weight, TensorParallel(
                    rank, size, row_parallel_chunks=chunks, row_parallel_chunk_threshold=1))
                if rank == 0:
                    results.put((tokens, chunks, baseline / chunked))
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--in-features", type=int, default=1536,
                        help="the layer's full input width (SmolLM2's MLP: 1536)")
    parser.add_argument("--out-features", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(args.tp, port, args, results), nprocs=args.tp,
                       start_method="spawn")
    speedups = {}
    while not results.empty():
        tokens, chunks, ratio = results.get()
        speedups[tokens, chunks] = ratio
    print(f"Tensor parallelism size equal to {args.tp} (gloo, {os.cpu_count()} CPU cores, "
          f"layer {args.in_features} -> {args.out_features}):")
    print("| Tokens | " + " | ".join(f"{c} chunks" for c in args.chunks) + " |")
    print("|---" * (len(args.chunks) + 1) + "|")
    for tokens in args.tokens:
        print(f"| {tokens} | " + " | ".join(f"{speedups[tokens, c]:.3f}" for c in args.chunks)
              + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
