"""Offline throughput: spmd-runtime against Hugging Face transformers' continuous batching, same run.

Both engines run the same model with the same weights: transformers' LlamaForCausalLM (sdpa)
is built from our model config and loaded with the state dict our workers load (its names are
transformers' own), so a dummy model carries the very same random weights (same --dummy-seed).
Both get the same random prompts and per-request output lengths, greedy decoding with EOS
ignored, the same dtype and device. Prints one table row per engine and the ratio.

    python bench/hf_peer.py --num-requests 32 --input-len-min 32 --input-len-max 256 --output-len 64
    python bench/hf_peer.py --workload issue10 --model-config llama-3.2-1b   # bf16 on a GPU

transformers' `generate_batch` takes one max_new_tokens for every prompt, so the requests go
through the manager it drives (`continuous_batching_context_manager`, `add_request` with each
request's own max_new_tokens), the same scheduler and batching. Timed from the first request's
submission to the last result: the manager's setup (KV cache allocation, CUDA-graph capture)
and a warm-up request are not timed, as our engine's startup and warm-up are not. Flash
attention is never switched in (auto_switch_to_flash=False): sdpa, as loaded.

The peer itself is spmd_runtime.launch.hf_peer, which `spmdrun bench throughput --with-peer`
runs after its own run; this script runs both engines in one process.
"""
from __future__ import annotations

import argparse
import os
import sys

from spmd_runtime.launch.bench import (
    TABLE_HEADER,
    ThroughputReport,
    add_peer_options,
    add_throughput_workload_options,
    run_throughput,
    throughput_workload_from_args,
)
from spmd_runtime.launch.hf_peer import run_transformers, same_sizes
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.model_config import MODEL_PRESETS
from spmd_runtime.runtime.loaders import load_model_config, resolve_model


def run_ours(model: str, prompts: list[list[int]], output_lens: list[int], dtype: str, device: str,
             seed: int, options: dict) -> ThroughputReport:
    from spmd_runtime.runtime import LLM
    with LLM(model, dtype=dtype, device=device, dummy_seed=seed, **options) as llm:
        return run_throughput(llm.client, prompts, output_lens, "spmd-runtime")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_throughput_workload_options(parser)
    parser.add_argument("--model", default="smollm2", help="our model name (default: %(default)s)")
    parser.add_argument("--model-config", choices=tuple(MODEL_PRESETS),
                        help="a built-in shape with random weights: --model dummy:<preset>")
    parser.add_argument("--dummy-seed", type=int, default=0, help="seed of dummy weights")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads of the transformers run")
    add_peer_options(parser)
    parser.add_argument("--peer-api", choices=("manager", "generate_batch"), default="manager",
                        help="manager: requests through generate_batch's manager, timed from the "
                        "first request to the last result, like ours; generate_batch: one "
                        "generate_batch call timed whole, its set-up included (fixed output "
                        "length only) (default: %(default)s)")
    args = parser.parse_args()
    try:
        workload = throughput_workload_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    model = f"dummy:{args.model_config}" if args.model_config else args.model
    prompts = workload.prompts(load_model_config(resolve_model(model)).vocab_size)
    output_lens = workload.output_lens()
    options = {}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    ours = run_ours(model, prompts, output_lens, args.dtype, args.device, args.dummy_seed, options)
    sizes = same_sizes(EngineConfig(**options)) if args.peer_cache == "same" else {}
    theirs = run_transformers(model, prompts, output_lens, args.dtype, args.device, args.dummy_seed,
                              args.threads, api=args.peer_api, **sizes)
    print(TABLE_HEADER)
    print(ours.row())
    print(theirs.row())
    print(f"workload: {workload.describe()}, seed {workload.seed}; model {model}")
    print(f"output tok/s ratio (spmd-runtime / transformers): "
          f"{ours.output_tokens_per_s / theirs.output_tokens_per_s:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
