"""`spmdrun bench throughput`'s workload and model options, and the transformers peer of
launch/hf_peer.py (same model, same weights, same greedy tokens as ours)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from spmd_runtime.launch import hf_peer
from spmd_runtime.launch.bench import THROUGHPUT_WORKLOADS, ThroughputWorkload, throughput_workload_from_args
from spmd_runtime.launch.cli import build_parser, config_from_args
from spmd_runtime.launch.command_options import bench_model, command_options


def _bench_args(*flags: str):
    return build_parser().parse_args(["bench", "throughput", *flags])


def test_issue10_workload_and_uniform_output_lengths() -> None:
    workload = throughput_workload_from_args(_bench_args("--workload", "issue10"))
    assert workload == ThroughputWorkload(256, 100, 1024, 100, 1024, seed=0)
    lens = workload.output_lens()
    assert len(lens) == 256 and min(lens) >= 100 and max(lens) <= 1024
    assert len(set(lens)) > 100, "output lengths should be spread over [100, 1024]"
    assert sum(lens) / len(lens) == pytest.approx(562, rel=0.1)
    assert lens == workload.output_lens(), "a seed gives the same lengths every time"
    assert lens != dataclasses.replace(workload, seed=1).output_lens()
    prompts = workload.prompts(128256)
    assert all(100 <= len(p) <= 1024 and all(1000 <= t < 128256 for t in p) for p in prompts)
    # The lengths come from a generator of their own: the vocabulary does not move them.
    assert workload.prompts(2048) != prompts

    # Options given override the workload's values; --output-len is min = max.
    args = _bench_args("--workload", "issue10", "--num-requests", "4", "--seed", "7",
                       "--output-len", "9")
    assert throughput_workload_from_args(args) == ThroughputWorkload(4, 100, 1024, 9, 9, seed=7)
    assert throughput_workload_from_args(args).output_lens() == [9] * 4
    assert throughput_workload_from_args(_bench_args()) == THROUGHPUT_WORKLOADS["default"]
    assert throughput_workload_from_args(_bench_args("--workload-seed", "3")).seed == 3
    with pytest.raises(ValueError, match="not both"):
        throughput_workload_from_args(_bench_args("--output-len", "4", "--output-len-max", "9"))
    with pytest.raises(ValueError, match="1 <= min <= max"):
        throughput_workload_from_args(_bench_args("--output-len-min", "20", "--output-len-max", "9"))


def test_the_peer_options_reach_the_throughput_bench() -> None:
    """One transformers peer, run by `spmdrun bench throughput --with-peer` (what
    bench/hf_peer.py did before it was folded in)."""
    options = command_options(_bench_args("--with-peer", "--peer-api", "generate_batch",
                                          "--peer-threads", "2", "--peer-cache", "same"))
    assert (options.with_peer, options.peer_api, options.peer_threads, options.peer_cache) == (
        True, "generate_batch", 2, "same")
    assert command_options(_bench_args()).peer_api == "manager"


def test_bench_model_spellings() -> None:
    def model(*flags: str) -> str:
        args = _bench_args(*flags)
        return bench_model(config_from_args(args), args.model_config, args.load_format,
                           "model" in args).model

    assert model() == "smollm2"
    assert model("--load-format", "dummy", "--model-config", "llama-3.2-1b") == "dummy:llama-3.2-1b"
    assert model("--model-config", "llama-3.2-1b") == "dummy:llama-3.2-1b"
    assert model("--load-format", "dummy") == "dummy:smollm2"
    assert model("--load-format", "dummy", "--model", "dummy:smollm2") == "dummy:smollm2"
    assert model("--model", "/some/dir") == "/some/dir"
    with pytest.raises(ValueError, match="--model or --model-config"):
        model("--model", "smollm2", "--model-config", "tiny-llama")
    with pytest.raises(SystemExit):
        _bench_args("--model-config", "no-such-preset")
    # The other benchmarks take the same spellings.
    args = build_parser().parse_args(["bench", "prefix", "--model-config", "tiny-llama"])
    assert bench_model(config_from_args(args), args.model_config, args.load_format,
                       "model" in args).model == "dummy:tiny-llama"


@pytest.mark.timeout(300)
def test_transformers_peer_runs_our_model_and_weights(tmp_path) -> None:
    """transformers, loaded by launch/hf_peer.py with our dummy weights, produces our greedy
    tokens (float32, CPU), per-request output lengths included; for the tied preset and for an
    untied variant (whose outputs depend on every weight, not mostly on the tied embedding)."""
    from spmd_runtime.protocol.model_config import model_preset
    from spmd_runtime.protocol.sampling import SamplingParams
    from spmd_runtime.runtime import LLM

    peer = hf_peer
    untied = tmp_path / "config.json"
    untied.write_text(json.dumps(dataclasses.replace(
        model_preset("tiny-llama"), tie_word_embeddings=False).to_hf_dict()))
    prompts = [[5, 17, 900, 33, 1200, 7], list(range(600, 900, 7)), [42] * 3]
    lens = [7, 12, 4]
    for model in ("dummy:tiny-llama", f"dummy:{untied}"):
        hf_model = peer.transformers_model(model, "float32", "cpu", seed=4)
        theirs, seconds = peer.generate_per_request(
            hf_model, prompts, lens, peer.batching_config(max_batch_tokens=256, kv_tokens=1024))
        assert seconds > 0
        with LLM(model, dtype="float32", device="cpu", dummy_seed=4, num_kv_blocks=32,
                 max_model_len=128) as llm:
            ours = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0,
                                                         ignore_eos=True) for n in lens])
        assert [o.token_ids for o in ours] == theirs, model
        assert [len(t) for t in theirs] == lens
    assert len(set(theirs[1])) > 3, "the untied model's output should not be one repeated token"
