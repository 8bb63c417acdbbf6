"""Bucketed scheduling on a fake worker: every step is a prompt or a decode step that fits the
bucket named in its plan, phases alternate (fifo) or prefer prompts (prefill_first), and the
padding and out-of-bucket counters add up."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from fake_engine import EOS, VOCAB, EngineLoop, FakeWorker, add, assert_pool_full, step, token_at
from spmd_runtime.launch.bench import THROUGHPUT_WORKLOADS
from spmd_runtime.protocol.buckets import BucketRange, PhaseBuckets
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.step_shape import Phase
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.scheduler import Scheduler


def buckets(prompt_bs=(1, 2, 4), prompt_seq=(16, 16, 64), decode_bs=(1, 4, 8),
            decode_seq=(32, 32, 128), budget=64) -> dict[Phase, PhaseBuckets]:
    return {"prompt": PhaseBuckets.generate("prompt", BucketRange(*prompt_bs),
                                            BucketRange(*prompt_seq), budget),
            "decode": PhaseBuckets.generate("decode", BucketRange(*decode_bs),
                                            BucketRange(*decode_seq), budget)}


def bucketed(policy="fifo", bucket_lists=None, **kwargs):
    """The fake engine with buckets, the way the server builds its scheduler."""
    kv = KVCacheManager(kwargs.pop("num_blocks", 64), 16)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=16, max_model_len=128,
                          eos_token_ids=[EOS], policy=policy,
                          buckets=bucket_lists or buckets(), **kwargs)
    return scheduler, EngineLoop(scheduler, FakeWorker(16, kv.num_blocks,
                                                       kwargs.get("num_cpu_blocks", 0)))


def check_plan_fits_its_bucket(scheduled, lengths_before: dict[int, int]) -> None:
    plan = scheduled.plan
    phase, bucket_bs, bucket_len = plan.bucket
    tokens = scheduled.num_scheduled
    assert len(tokens) <= bucket_bs
    if phase == "decode":
        assert all(n == 1 for n in tokens.values())
        assert all(lengths_before[rid] + 1 <= bucket_len for rid in tokens)
    else:
        assert all(n <= bucket_len for n in tokens.values())
        assert sum(tokens.values()) <= bucket_bs * bucket_len


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("seed", range(6))
def test_bucketed_steps_are_single_phase_fit_their_bucket_and_lose_nothing(policy, seed) -> None:
    rng = random.Random(seed)
    scheduler, loop = bucketed(policy, num_cpu_blocks=rng.choice([0, 16]),
                               num_blocks=rng.choice([24, 64]))
    requests = [add(scheduler, rid, 0, prompt=[rng.randrange(10, VOCAB)
                                               for _ in range(rng.randint(1, 70))],
                    max_tokens=rng.randint(1, 40)) for rid in range(12)]
    phases = []
    for _ in range(2000):
        if not scheduler.has_work:
            break
        computed = {r.request_id: r.num_computed_tokens for r in scheduler.requests.values()}
        scheduled, update = loop.step()
        if update is None:
            continue
        if scheduled.plan.bucket is not None:
            check_plan_fits_its_bucket(scheduled, computed)
        phases.append(scheduled.plan.bucket[0] if scheduled.plan.bucket else "outside")
    loop.idle()
    assert {"prompt", "decode"} <= set(phases)
    for r in requests:
        n = len(r.prompt_token_ids)
        assert r.output_token_ids == [token_at(r.request_id, n + i)
                                      for i in range(r.params.max_tokens)]
    assert_pool_full(scheduler)


def test_fifo_alternates_phases_while_both_have_work() -> None:
    scheduler, loop = bucketed("fifo")
    add(scheduler, 0, prompt_len=8, max_tokens=20)
    step(scheduler, loop)                                   # prompt step
    for rid in range(1, 4):
        add(scheduler, rid, prompt_len=60, max_tokens=2)
    kinds = [step(scheduler, loop)[0].plan.bucket[0] for _ in range(4)]
    assert kinds == ["decode", "prompt", "decode", "prompt"]


def test_prefill_first_runs_prompt_steps_while_prefill_work_is_left() -> None:
    scheduler, loop = bucketed("prefill_first")
    add(scheduler, 0, prompt_len=8, max_tokens=20)
    step(scheduler, loop)
    for rid in range(1, 4):
        add(scheduler, rid, prompt_len=60, max_tokens=2)
    kinds = [step(scheduler, loop)[0].plan.bucket[0] for _ in range(4)]
    assert kinds[:3] == ["prompt"] * 3                      # 3 x 60 tokens, at most 64 a step
    assert "decode" in kinds


def test_padding_is_counted_against_computed_tokens() -> None:
    scheduler, loop = bucketed("fifo")
    add(scheduler, 0, prompt_len=10, max_tokens=1)
    add(scheduler, 1, prompt_len=20, max_tokens=1)
    scheduled, _ = step(scheduler, loop)
    assert scheduled.plan.bucket == ("prompt", 2, 32)         # 2 sequences, longest 20
    counters = scheduler.planner.counters
    assert (counters.computed_tokens, counters.padded_tokens) == (30, 64 - 30)
    assert counters.padding_waste == pytest.approx(34 / 30)


def test_decodes_longer_than_every_bucket_still_batch_and_are_counted() -> None:
    scheduler, loop = bucketed("fifo", buckets(decode_seq=(32, 32, 64)))
    requests = [add(scheduler, rid, prompt_len=60, max_tokens=40) for rid in range(3)]
    outside_sizes = []
    for _ in range(2000):
        if not scheduler.has_work:
            break
        scheduled, update = loop.step()
        if update is not None and scheduled.plan.bucket is None:
            outside_sizes.append(len(scheduled.num_scheduled))
    loop.idle()
    assert scheduler.planner.counters.batches_outside_buckets == len(outside_sizes) > 0
    assert max(outside_sizes) == 3, "contexts past 64 tokens still decode together"
    for r in requests:
        assert r.output_token_ids == [token_at(r.request_id, 60 + i) for i in range(40)]
    assert_pool_full(scheduler)


def packed_prompts(decode_bs=(1, 4, 8), decode_seq=(128, 128, 128)) -> dict[Phase, PhaseBuckets]:
    """What a GPU engine gets: prompt steps packed, decode buckets by batch size alone."""
    return {"prompt": PhaseBuckets.packed_steps("prompt"),
            "decode": PhaseBuckets.generate("decode", BucketRange(*decode_bs),
                                            BucketRange(*decode_seq), 64)}


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_packed_prompt_steps_run_unpadded_up_to_the_token_budget(policy) -> None:
    rng = random.Random(7)
    scheduler, loop = bucketed(policy, packed_prompts())
    requests = [add(scheduler, rid, 0, prompt=[rng.randrange(10, VOCAB)
                                               for _ in range(rng.randint(1, 100))],
                    max_tokens=rng.randint(1, 20)) for rid in range(10)]
    prompt_tokens, decode_padding = 0, 0
    for _ in range(2000):
        if not scheduler.has_work:
            break
        scheduled, update = loop.step()
        if update is None:
            continue
        tokens = scheduled.num_scheduled
        if scheduled.plan.bucket is None:                     # a packed prompt step
            assert sum(tokens.values()) <= 64
            prompt_tokens += sum(tokens.values())
        else:
            phase, bucket_bs, _ = scheduled.plan.bucket
            assert phase == "decode" and set(tokens.values()) == {1}
            decode_padding += bucket_bs - len(tokens)
    loop.idle()
    # Prompts of up to 100 tokens were chunked by the budget (64), not by a bucket length.
    assert any(n == 64 for plan in loop.worker.plans for n in
               [*(r.num_scheduled_tokens for r in plan.new_requests),
                *plan.cached_num_scheduled_tokens])
    counters = scheduler.planner.counters
    assert counters.batches_outside_buckets == 0
    assert counters.padded_tokens == decode_padding
    assert counters.computed_tokens >= prompt_tokens > 0
    for r in requests:
        n = len(r.prompt_token_ids)
        assert r.output_token_ids == [token_at(r.request_id, n + i)
                                      for i in range(r.params.max_tokens)]
    assert_pool_full(scheduler)


def scheduler_overhead_bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "scheduler_overhead.py"
    spec = importlib.util.spec_from_file_location("scheduler_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_the_issue10_workload_pads_under_a_tenth_of_what_it_computes() -> None:
    """Issue 31: 256 requests, prompts and outputs U[100, 1024], as a GPU engine schedules
    them. The (batch, length) buckets of before padded it by ~38%."""
    bench = scheduler_overhead_bench()
    config = EngineConfig(model="unused", **bench.GPU_ENGINE)
    workload = THROUGHPUT_WORKLOADS["issue10"]
    packed = bench.serve_workload(workload, config, bench.gpu_buckets(config, "packed"))
    assert packed["packed_phases"] == ["prompt"] and packed["batches_outside_buckets"] == 0
    assert packed["num_buckets"]["decode"] == 35
    assert packed["padding_waste"] < 0.10
    # Every prompt and output token was computed (the last output token is never fed back).
    assert packed["computed_tokens"] == sum(len(p) for p in workload.prompts(32000)) + sum(
        n - 1 for n in workload.output_lens())
    padded = bench.serve_workload(workload, config, bench.gpu_buckets(config, "padded"))
    assert padded["computed_tokens"] == packed["computed_tokens"]
    assert padded["padding_waste"] > 0.3


def periodic(request_id: int, position: int) -> int:
    """A fake model whose tokens repeat every five positions: prompt lookup finds them."""
    return 10 + (request_id + position) % 5


@pytest.mark.parametrize("num_requests", [1, 3, 6])
def test_verifying_requests_take_decode_rows_of_a_bucket(num_requests) -> None:
    """Prompt lookup with buckets: a request verifying k proposals takes 1 + k rows of a decode
    step, and the step pads to a decode bucket holding all its rows and its longest context
    (one row over three requests of 4 + 1 does not fit 8: they propose fewer). The outputs
    are the fake model's, whatever was accepted."""
    from spmd_runtime.scheduler_proc.speculation import Speculator

    scheduler, loop = bucketed(speculator=Speculator(4, 1, 3, 16))
    requests = [add(scheduler, rid, 0, prompt=[periodic(rid, p) for p in range(12)],
                    max_tokens=30) for rid in range(num_requests)]
    verify_steps = 0
    for _ in range(500):
        if not scheduler.has_work:
            break
        before = {r.request_id: r.num_computed_tokens for r in scheduler.requests.values()}
        scheduled, update = loop.step(periodic)
        if update is None or not scheduled.plan.spec_token_ids:
            continue
        verify_steps += 1
        phase, bucket_rows, bucket_len = scheduled.plan.bucket
        rows = scheduled.num_scheduled
        assert phase == "decode" and sum(rows.values()) <= bucket_rows, scheduled.plan
        assert all(before[rid] + n <= bucket_len for rid, n in rows.items()), scheduled.plan
    loop.idle()
    assert verify_steps > 0
    assert scheduler.speculator.counters.num_accepted_tokens > 0
    for r in requests:
        assert r.output_token_ids == [periodic(r.request_id, 12 + i) for i in range(30)]
    assert_pool_full(scheduler)
