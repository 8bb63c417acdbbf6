"""Bucket ranges, bucket lists, bucket choice and capture orders (protocol/buckets.py), against
the figures of the bucketing source document."""
from __future__ import annotations

import os

import pytest
from spmd_runtime.protocol.buckets import (
    BucketRange,
    PhaseBuckets,
    capture_order,
    default_ranges,
    engine_buckets,
    packs_prompts,
    plan_graph_captures,
    resolve_ranges,
)
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.config_resolve import environment_options

PROMPT = PhaseBuckets.generate("prompt", BucketRange(1, 32, 4), BucketRange(128, 128, 1024), 4096)
DECODE = PhaseBuckets.generate("decode", BucketRange(1, 128, 4), BucketRange(128, 128, 2048), 4096)


def test_ranges_ramp_up_by_powers_of_two_then_step() -> None:
    assert BucketRange(2, 32, 64).values() == [2, 4, 8, 16, 32, 64]
    assert BucketRange(128, 128, 512).values() == [128, 256, 384, 512]
    assert BucketRange(1, 32, 4).values() == [1, 2, 4]
    assert BucketRange(1, 4, 12).values() == [1, 2, 4, 8, 12]


def test_the_24_prompt_buckets() -> None:
    seqs = [128 * i for i in range(1, 9)]
    assert list(PROMPT.buckets) == [(b, s) for b in (1, 2, 4) for s in seqs]
    assert len(PROMPT.buckets) == 24
    assert PROMPT.config_line() == "Prompt bucket config (min, step, max) bs:[1, 32, 4], seq:[128, 128, 1024]"
    assert PROMPT.list_line().startswith("Generated 24 prompt buckets: [(1, 128), (1, 256),")


def test_the_48_decode_buckets_in_order() -> None:
    assert len(DECODE.buckets) == 48
    assert DECODE.buckets[:2] == ((1, 128), (1, 256))
    assert DECODE.buckets[15:17] == ((1, 2048), (2, 128))
    assert DECODE.buckets[-1] == (4, 2048)
    assert list(DECODE.buckets) == sorted(DECODE.buckets)


def test_buckets_outside_the_token_budget_are_dropped() -> None:
    prompt = PhaseBuckets.generate("prompt", BucketRange(1, 32, 4), BucketRange(128, 128, 1024), 1024)
    assert max(b * s for b, s in prompt.buckets) <= 1024
    assert (4, 256) in prompt.buckets and (4, 384) not in prompt.buckets
    decode = PhaseBuckets.generate("decode", BucketRange(1, 32, 64), BucketRange(128, 128, 256), 16)
    assert {b for b, _ in decode.buckets} == {1, 2, 4, 8, 16}


def test_a_batch_runs_as_the_smallest_bucket_that_fits() -> None:
    assert PROMPT.find(3, 412) == (4, 512)
    assert PROMPT.find(1, 1) == (1, 128)
    assert PROMPT.find(4, 1024) == (4, 1024)
    assert DECODE.find(2, 513) == (2, 640)


def test_no_bucket_above_the_largest() -> None:
    assert PROMPT.find(5, 128) is None
    assert PROMPT.find(1, 1025) is None
    assert DECODE.find(4, 2049) is None


def test_a_missing_pair_falls_back_to_the_fewest_tokens_that_fit() -> None:
    prompt = PhaseBuckets.generate("prompt", BucketRange(1, 32, 4), BucketRange(128, 128, 512), 1024)
    assert (4, 384) not in prompt.buckets
    assert prompt.find(3, 300) is None        # (4, 384) and (4, 512) are over budget
    assert prompt.find(2, 300) == (2, 384)


def test_capture_orders() -> None:
    buckets = [(1, 128), (1, 256), (32, 128), (32, 256), (64, 128), (64, 256)]
    assert capture_order(buckets, "max_bs") == [(64, 128), (64, 256), (32, 128), (32, 256),
                                                (1, 128), (1, 256)]
    assert capture_order([(2, 512), (4, 128), (1, 256), (1, 1024)], "min_tokens") == [
        (1, 256), (4, 128), (1, 1024), (2, 512)]
    with pytest.raises(ValueError, match="max_bs or min_tokens"):
        capture_order(buckets, "largest")


def test_options_then_environment_then_defaults() -> None:
    defaults = default_ranges("decode", max_num_seqs=64, max_num_batched_tokens=1024,
                              max_model_len=8192, block_size=16)
    assert defaults["bs"] == BucketRange(1, 32, 64)
    assert defaults["seq"] == BucketRange(128, 128, 8192)
    env = {"SPMD_DECODE_BS_BUCKET_MAX": "16", "SPMD_DECODE_SEQ_BUCKET_STEP": "256"}
    ranges = resolve_ranges(decode_options(env), defaults)
    assert ranges == {"bs": BucketRange(1, 32, 16), "seq": BucketRange(128, 256, 8192)}
    ranges = resolve_ranges(decode_options(env, decode_bs_bucket="2,4,8"), defaults)
    assert ranges["bs"] == BucketRange(2, 4, 8)
    with pytest.raises(ValueError, match="SPMD_DECODE_BS_BUCKET_MAX"):
        resolve_ranges(decode_options({"SPMD_DECODE_BS_BUCKET_MAX": "many"}), defaults)
    with pytest.raises(ValueError, match="min,step,max"):
        resolve_ranges({"seq": "128,256"}, defaults)


def decode_options(environ: dict[str, str], **options) -> dict[str, str]:
    """The decode bucket options of a config made with this environment: its variables are
    folded in where the config is made (protocol/config_resolve.py)."""
    config = EngineConfig(model="unused", **{**environment_options(options, environ), **options})
    return {"bs": config.decode_bs_bucket, "seq": config.decode_seq_bucket}


def test_default_prompt_ranges_cover_the_token_budget() -> None:
    ranges = default_ranges("prompt", max_num_seqs=64, max_num_batched_tokens=1024,
                            max_model_len=8192, block_size=16)
    prompt = PhaseBuckets.generate("prompt", ranges["bs"], ranges["seq"], 1024)
    assert prompt.find(1, 1024) == (1, 1024)
    assert prompt.find(8, 128) == (8, 128)


SEED_STRATEGIES = {"prompt": "min_tokens", "decode": "max_bs"}


class Costs:
    """A fake capture: prompt graphs take 1 KiB per token (batch size x length), decode
    graphs 1 KiB per batch row (they share the pool); records the capture sequence."""

    def __init__(self) -> None:
        self.sequence: list[tuple[str, tuple[int, int]]] = []

    def __call__(self, phase: str, bucket: tuple[int, int]) -> int:
        self.sequence.append((phase, bucket))
        return 1024 * (bucket[0] * bucket[1] if phase == "prompt" else bucket[0])


def test_graph_captures_follow_each_phase_strategy_within_its_share() -> None:
    costs = Costs()
    budget = 10 * 2**20
    reports = plan_graph_captures({"prompt": PROMPT.buckets, "decode": DECODE.buckets},
                                  budget, 0.3, SEED_STRATEGIES, costs)
    prompt, decode = reports["prompt"], reports["decode"]
    # Decode is cheap: all 48, in max_bs order (batch size 4 first, shortest context first).
    assert len(decode.captured) == 48 and decode.captured[:2] == [(4, 128), (4, 256)]
    assert decode.used_bytes == 1024 * (16 * 4 + 16 * 2 + 16 * 1)
    # Prompt: smallest token counts first. 30% of 10 MiB = 3 MiB = 3072 tokens' worth in the
    # first pass: (1,128) ... up to 3072 tokens in total.
    first_pass = [b for phase, b in costs.sequence[:costs.sequence.index(("decode", (4, 128)))]]
    assert first_pass == capture_order(PROMPT.buckets, "min_tokens")[:len(first_pass)]
    assert sum(b * s for b, s in first_pass) * 1024 <= 0.3 * budget
    # Second pass: what decode left over goes to more prompt graphs, within the whole budget.
    second_pass = costs.sequence[costs.sequence.index(("decode", (1, 2048))) + 1:]
    assert second_pass and all(phase == "prompt" for phase, _ in second_pass)
    assert prompt.used_bytes + decode.used_bytes <= budget
    assert len(prompt.captured) < 24
    assert prompt.line().startswith(f"Graph/Prompt captured:{len(prompt.captured)} (")
    assert "used_mem:" in prompt.line() and "buckets:[(1, 128)" in prompt.line()


def test_a_bucket_over_what_is_left_is_skipped_for_smaller_ones_after_it() -> None:
    costs = Costs()
    # max_bs order for prompt: (4, 128) then (4, 256) [too big once 512 tokens are spent],
    # then (2, 128) still fits.
    reports = plan_graph_captures({"prompt": [(4, 128), (4, 256), (2, 128)], "decode": []},
                                  1024 * 1000, 1.0, {"prompt": "max_bs", "decode": "max_bs"},
                                  costs)
    assert reports["prompt"].captured == [(4, 128), (2, 128)]
    assert reports["decode"].line().startswith("Graph/Decode captured:0 (0.0%)")


def test_no_graph_memory_captures_nothing() -> None:
    costs = Costs()
    reports = plan_graph_captures({"prompt": PROMPT.buckets, "decode": DECODE.buckets},
                                  0, 0.3, SEED_STRATEGIES, costs)
    assert costs.sequence == [] and all(not r.captured for r in reports.values())


# ---------------------------------------------------------------- what changes a graph

def clear_bucket_environment(monkeypatch) -> None:
    for name in [n for n in os.environ if "_BUCKET_" in n]:
        monkeypatch.delenv(name)


GPU = dict(model="unused", device="cuda", execution_mode="compiled", max_num_seqs=256,
           max_num_batched_tokens=8192, max_model_len=2176)


def test_a_gpu_engine_packs_prompts_and_keys_decode_graphs_by_batch_size(monkeypatch) -> None:
    clear_bucket_environment(monkeypatch)
    buckets = engine_buckets(EngineConfig(**GPU), 2176, "cuda", context_from_tensors=True)
    assert buckets["prompt"].packed and buckets["prompt"].buckets == ()
    assert "packed" in buckets["prompt"].config_line()
    # One context length, the longest (17 x 128 tokens); batch sizes 1, 2, 4, 8, then every 8.
    assert buckets["decode"].buckets == tuple(
        (bs, 2176) for bs in [1, 2, 4, *range(8, 257, 8)])
    assert buckets["decode"].find(250, 37) == (256, 2176)
    # An attention that masks a gathered context keeps the context dimension.
    gathered = engine_buckets(EngineConfig(**GPU), 2176, "cuda", context_from_tensors=False)
    assert {s for _, s in gathered["decode"].buckets} == set(range(128, 2177, 128))


def test_prompt_buckets_asked_for_or_no_graphs_keep_prompts_padded(monkeypatch) -> None:
    clear_bucket_environment(monkeypatch)
    config = EngineConfig(**GPU)
    assert packs_prompts(config, "cuda")
    assert not packs_prompts(config, "cpu"), "CPU compiled: torch.compile per token count"
    assert not packs_prompts(EngineConfig(**dict(GPU, execution_mode="bucketed")), "cuda")
    assert not packs_prompts(EngineConfig(**dict(GPU, prompt_seq_bucket="64,64,512")), "cuda")
    # A prompt bucket asked for through the environment, folded into the config where it is made.
    asked = EngineConfig(**GPU, **environment_options(GPU, {"SPMD_PROMPT_BS_BUCKET_MAX": "4"}))
    assert asked.prompt_bs_bucket == ",,4" and not packs_prompts(asked, "cuda")
    assert not engine_buckets(asked, 2176, "cuda", True)["prompt"].packed
    # Without graphs, decode batch sizes keep their coarser default steps.
    cpu = engine_buckets(EngineConfig(**dict(GPU, device="cpu")), 2176, "cpu", True)
    assert [bs for bs, _ in cpu["decode"].buckets][:7] == [1, 2, 4, 8, 16, 32, 64]


def test_find_uses_the_grid_and_falls_back_where_the_budget_cut_it() -> None:
    # 4 x 128 = 512 tokens: the budget of 256 cuts (4, 128), (2, 128) stays.
    prompt = PhaseBuckets.generate("prompt", BucketRange(1, 4, 4), BucketRange(64, 64, 128), 256)
    assert not prompt.is_grid and DECODE.is_grid
    assert prompt.find(3, 100) is None
    assert prompt.find(2, 100) == (2, 128)
    assert prompt.find(3, 60) == (4, 64)
