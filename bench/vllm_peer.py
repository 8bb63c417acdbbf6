"""vLLM's CPU backend as a peer of bench/cpu_peers.py: runs a spec (see peer_common) through one
vllm.LLM and writes the result rows. Runs in vLLM's venv (bench/setup_vllm_cpu.sh) and imports
none of our packages; cpu_peers.py starts it with the environment vLLM's CPU backend needs.

    $VLLM_VENV/bin/python bench/vllm_peer.py SPEC.json RESULT.json [PROFILE_DIR]

With PROFILE_DIR, the spec runs once untimed, then once more under vLLM's own torch profiler
(its profiler_config), whose traces land in PROFILE_DIR (bench/vllm_profile.py reads them).

The engine is built once (start-up not timed, reported as startup_s) with float32 weights, the
spec's max_num_seqs and max_model_len, and vLLM's defaults otherwise (prefix caching on, chunked
prefill, 4096 batched tokens a step on CPU). Prompts go in as token ids.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from peer_common import Generate, read_json, run_spec, write_json

ENGINE = "vLLM (CPU)"


def vllm_generate(llm) -> Generate:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def generate(prompts: Sequence[Sequence[int]], output_lens: Sequence[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                               use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def main(spec_path: str, result_path: str, profile_dir: str = "") -> int:
    from vllm import LLM

    spec = read_json(spec_path)
    profiling = {"profiler_config": {"profiler": "torch", "torch_profiler_dir": profile_dir,
                                     "torch_profiler_with_stack": False,
                                     "torch_profiler_use_gzip": False}} if profile_dir else {}
    started = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec.get("dtype", "float32"), max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], seed=0, **profiling)
    startup_s = time.perf_counter() - started
    if profile_dir:
        run_spec(ENGINE, spec["runs"], vllm_generate(llm))
        llm.start_profile()
    results = run_spec(ENGINE, spec["runs"], vllm_generate(llm))
    if profile_dir:
        llm.stop_profile()
    write_json(result_path, {"engine": ENGINE, "startup_s": startup_s, "results": results})
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(f"usage: {sys.argv[0]} SPEC.json RESULT.json [PROFILE_DIR]")
    sys.exit(main(*sys.argv[1:]))
