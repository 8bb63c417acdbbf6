"""Overlapped steps in ModelRunner: step N+1 is prepared and launched before step N is finished,
its inputs taking N's sampled tokens on the device. The tokens must be those of running the
same plans one at a time, through the eager path and through (emulated) decode graphs, with a
chunked prompt finishing mid-pipeline, a request dropped and a seeded sampled one joining."""
from __future__ import annotations

import copy

import pytest
import torch
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.runtime.layers.attention_backend import TORCH, TRITON
from spmd_runtime.worker_proc.graphs import GraphCapturer
from spmd_runtime.worker_proc.kv_cache import allocate_kv_cache
from spmd_runtime.worker_proc.model_runner import UNREAD_TOKEN, ModelRunner
from test_graphs import BUCKETS, STRATEGIES, capture_all, make_runner
from test_model_runner import GREEDY, NUM_BLOCKS, build_pair, prompt

SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=100)
BLOCKS = 8


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=5)


def blocks_of(request_id: int) -> list[int]:
    return list(range(request_id * BLOCKS, (request_id + 1) * BLOCKS))


class Plans:
    """Builds the workload's plans without knowing any token (as the scheduler does ahead):
    tracks each request's context length; decode-only steps get a decode bucket if asked."""

    def __init__(self, buckets: bool) -> None:
        self.buckets = buckets
        self.lengths: dict[int, int] = {}
        self.plans: list[StepPlan] = []

    def add(self, new=(), cached=(), dropped=()) -> None:
        """new: (id, tokens, scheduled, params); cached: (id, scheduled)."""
        for rid, _, scheduled, _ in new:
            self.lengths[rid] = scheduled
        for rid, scheduled in cached:
            self.lengths[rid] += scheduled
        bucket = None
        if self.buckets and not new and all(n == 1 for _, n in cached):
            longest = max(self.lengths[rid] for rid, _ in cached)
            bucket = StepShape(Phase.DECODE, *BUCKETS["decode"].find(len(cached), longest))
        self.plans.append(StepPlan(
            step_id=len(self.plans),
            new_requests=[NewRequestData(rid, tokens, blocks_of(rid), 0, scheduled, params)
                          for rid, tokens, scheduled, params in new],
            cached_request_ids=[rid for rid, _ in cached],
            cached_num_scheduled_tokens=[n for _, n in cached],
            cached_new_block_ids=[[] for _ in cached], dropped_request_ids=list(dropped),
            bucket=bucket))


def workload(buckets: bool) -> list[StepPlan]:
    plans = Plans(buckets)
    # Request 2's 14-token prompt in two chunks: it samples only at the end of the second.
    plans.add(new=[(0, prompt(1, 5), 5, GREEDY), (1, prompt(2, 9), 9, GREEDY),
                   (2, prompt(3, 14), 8, GREEDY)])
    plans.add(cached=[(0, 1), (1, 1), (2, 6)])
    for _ in range(6):
        plans.add(cached=[(0, 1), (1, 1), (2, 1)])
    # Request 0 leaves; a seeded sampled request joins.
    plans.add(new=[(3, prompt(4, 6), 6, SEEDED)], cached=[(1, 1), (2, 1)], dropped=[0])
    for _ in range(6):
        plans.add(cached=[(1, 1), (2, 1), (3, 1)])
    return plans.plans


def one_at_a_time(runner: ModelRunner, plans: list[StepPlan]) -> list[dict[int, int]]:
    outputs = [runner.execute(plan) for plan in plans]
    return [dict(zip(o.request_ids, o.sampled_token_ids, strict=True)) for o in outputs]


def overlapped(runner: ModelRunner, plans: list[StepPlan]) -> list[dict[int, int]]:
    """Each plan prepared and launched before the step before it is finished."""
    outputs, in_flight = [], None
    for plan in plans:
        launched = runner.launch(runner.prepare(plan), in_flight)
        if in_flight is not None:
            outputs.append(runner.finish(in_flight))
        in_flight = launched
    outputs.append(runner.finish(in_flight))
    return [dict(zip(o.request_ids, o.sampled_token_ids, strict=True)) for o in outputs]


class Fills:
    """Counts the steps whose inputs took tokens from the step in flight, and how many."""

    def __init__(self, runner: ModelRunner) -> None:
        self.steps = 0
        self.tokens = 0
        fill = type(runner)._fill_unread

        def counting(input_ids, step, in_flight):
            if step.unread_positions:
                self.steps += 1
                self.tokens += len(step.unread_positions)
            return fill(runner, input_ids, step, in_flight)

        runner._fill_unread = counting


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_overlapped_steps_sample_what_one_at_a_time_samples(pair, graphs) -> None:
    _, model, config = pair
    plans = workload(buckets=graphs)
    expected_runner = make_runner(model, config)
    runner = make_runner(model, config)
    if graphs:
        capture_all(expected_runner)
        capture_all(runner)
    expected = one_at_a_time(expected_runner, plans)
    fills = Fills(runner)
    assert overlapped(runner, plans) == expected
    # Every step after the first took the tokens of the one before from the device: 2 at the
    # second (request 2 was mid-prompt), 3 at the next six, 2 at the ninth (request 0 gone,
    # request 3 new), 3 at the last six.
    assert fills.steps == len(plans) - 1 == 14
    assert fills.tokens == 2 + 3 * 6 + 2 + 3 * 6
    # The host state caught up with the device: no placeholder left, same tokens.
    for rid in (1, 2, 3):
        state, reference = runner.requests[rid], expected_runner.requests[rid]
        assert UNREAD_TOKEN not in state.token_ids
        assert state.token_ids == reference.token_ids and state.unread is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", [TORCH, TRITON], ids=["torch-attention", "triton-kernel"])
def test_overlapped_steps_on_cuda_with_real_graphs(pair, kernel) -> None:
    """On CUDA the launch returns before the device runs the step: the next step's inputs are
    copied, filled from the unread tokens and replayed while the step before still runs."""
    _, model, config = pair
    device = torch.device("cuda")
    cuda_model = copy.deepcopy(model).to(device)

    def runner() -> ModelRunner:
        kv = allocate_kv_cache(config, NUM_BLOCKS, 4, torch.float32, device)
        built = ModelRunner(cuda_model, kv, 4, device, seed=0, attention=kernel)
        built.graph_runner.capture_graphs(BUCKETS, 1 << 30, 0.3, STRATEGIES, lambda: 0, GraphCapturer(device))
        return built

    plans = workload(buckets=True)
    expected = one_at_a_time(runner(), plans)
    overlapping = runner()
    fills = Fills(overlapping)
    assert overlapped(overlapping, plans) == expected
    assert fills.steps == len(plans) - 1
    # And on the CPU path, the same greedy tokens (the seeded request's draws come from
    # another generator on another device: compared for the greedy requests only).
    cpu = one_at_a_time(make_runner(model, config), workload(buckets=False))
    assert [{r: t for r, t in step.items() if r != 3} for step in expected] == \
        [{r: t for r, t in step.items() if r != 3} for step in cpu]


def test_a_step_that_needs_tokens_in_flight_is_refused_without_them(pair) -> None:
    _, model, config = pair
    runner = make_runner(model, config)
    plans = workload(buckets=False)
    runner.launch(runner.prepare(plans[0]))
    with pytest.raises(RuntimeError, match="in_flight"):
        runner.launch(runner.prepare(plans[1]))


def test_without_the_device_fill_the_placeholder_reaches_the_model(pair) -> None:
    """The fill is what makes the overlapped inputs right: skipped, the embedding is asked for
    token -1 (an error on CPU; on CUDA, garbage)."""
    _, model, config = pair
    runner = make_runner(model, config)
    runner._fill_unread = lambda input_ids, step, in_flight: None
    with pytest.raises(IndexError):
        overlapped(runner, workload(buckets=False)[:3])


def test_idle_and_device_time_are_reported(pair) -> None:
    _, model, config = pair
    runner = make_runner(model, config)
    plans = workload(buckets=False)
    first = runner.execute(plans[0])
    assert first.idle_ms is None and first.forward_ms > 0      # no step before it
    second = runner.execute(plans[1])
    assert second.idle_ms is not None and second.idle_ms >= 0 and second.forward_ms > 0


def test_swaps_are_not_prepared_ahead(pair) -> None:
    _, model, config = pair
    runner = make_runner(model, config)
    plan = workload(buckets=False)[1]
    assert runner.can_prepare_ahead(plan)
    for swaps in ({"swap_out": [(1, 0)]}, {"swap_in": [(1, 0)]}):
        assert not runner.can_prepare_ahead(StepPlan(**{**{f: getattr(plan, f) for f in
                                                          plan.__struct_fields__}, **swaps}))
