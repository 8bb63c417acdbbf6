"""Bucket graphs: the static-input path a captured graph replays gives the eager path's tokens.

On CPU the capturer emulates replay by running the forward pass on the graph's static tensors,
so these tests check everything but the CUDA recording itself: the fixed bucket layouts, the
copy of each batch into the static tensors, the one-prompt-per-row layout of prompt graphs,
padding that never reaches a real KV block, the eager fallback of prompts with cached
context, and steps verifying speculative proposals as decode rows, one per token. The same
comparison on CUDA, with real graphs, is in tests/runtime/test_bucketing_engine.py. The
capturer's use of graph memory pools is checked against a model of the CUDA allocator's.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from cpu_library import needs_cpu_ops
from spmd_runtime.protocol.buckets import BucketRange, PhaseBuckets
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.runtime.layers.attention_backend import CPP
from spmd_runtime.worker_proc.graphs import BucketGraph, GraphCapturer, StaticInputs
from spmd_runtime.worker_proc.kv_cache import allocate_kv_cache
from spmd_runtime.worker_proc.model_runner import ModelRunner
from test_model_runner import BLOCK, GREEDY, NUM_BLOCKS, build_pair, prompt

BUCKETS = {
    "prompt": PhaseBuckets.generate("prompt", BucketRange(1, 2, 4), BucketRange(8, 8, 16), 64),
    "decode": PhaseBuckets.generate("decode", BucketRange(1, 2, 4), BucketRange(8, 8, 32), 64),
}
STRATEGIES = {"prompt": "min_tokens", "decode": "max_bs"}
BLOCKS_PER_REQUEST = 8


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=3)


def make_runner(model, config) -> ModelRunner:
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"))
    for k, v in kv:
        k.fill_(0.5)        # stale content the masks must hide
        v.fill_(-0.5)
    return ModelRunner(model, kv, BLOCK, torch.device("cpu"), seed=0)


class Replays:
    """Counts graph replays per bucket."""

    def __init__(self, runner: ModelRunner) -> None:
        self.counts: dict[tuple[str, int, int], int] = {}
        for key, graph in runner.graphs.items():
            graph.replay = self._counting(key, graph.replay)

    def _counting(self, key, replay):
        def counted():
            self.counts[key] = self.counts.get(key, 0) + 1
            return replay()
        return counted


class Driver:
    """Feeds the same bucketed plans to a runner and records what it samples."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step = 0

    def prefill(self, requests: list[tuple[int, list[int], list[int], int]]) -> dict[int, int]:
        """requests: (id, tokens, blocks, computed tokens); runs one prompt step."""
        longest = max(len(tokens) - computed for _, tokens, _, computed in requests)
        bucket = BUCKETS["prompt"].find(len(requests), longest)
        plan = StepPlan(step_id=self.step, new_requests=[
            NewRequestData(rid, tokens, blocks, computed, len(tokens) - computed, GREEDY)
            for rid, tokens, blocks, computed in requests], cached_request_ids=[],
            cached_num_scheduled_tokens=[], cached_new_block_ids=[],
            bucket=StepShape(Phase.PROMPT, *bucket))
        return self._run(plan)

    def decode(self, request_ids: list[int]) -> dict[int, int]:
        states = self.runner.requests
        longest = max(states[r].num_computed_tokens + 1 for r in request_ids)
        bucket = BUCKETS["decode"].find(len(request_ids), longest)
        plan = StepPlan(step_id=self.step, new_requests=[], cached_request_ids=list(request_ids),
                        cached_num_scheduled_tokens=[1] * len(request_ids),
                        cached_new_block_ids=[[] for _ in request_ids],
                        bucket=StepShape(Phase.DECODE, *bucket))
        return self._run(plan)

    def verify(self, proposals: dict[int, list[int]], bucketed: bool = True
               ) -> dict[int, list[int]]:
        """One step in which each request computes its last token and its proposals (none:
        a plain decode), in the decode bucket of its rows (one a token) or unpadded; each
        request's output tokens."""
        states = self.runner.requests
        ids = list(proposals)
        counts = [1 + len(proposals[r]) for r in ids]
        longest = max(states[r].num_computed_tokens + n for r, n in zip(ids, counts, strict=True))
        bucket = BUCKETS["decode"].find(sum(counts), longest) if bucketed else None
        plan = StepPlan(step_id=self.step, new_requests=[], cached_request_ids=ids,
                        cached_num_scheduled_tokens=counts, cached_new_block_ids=[[] for _ in ids],
                        bucket=StepShape(Phase.DECODE, *bucket) if bucket else None,
                        spec_token_ids=[(r, p) for r, p in proposals.items() if p])
        self.step += 1
        output = self.runner.execute(plan)
        outputs = {rid: [token] for rid, token in zip(output.request_ids,
                                                       output.sampled_token_ids, strict=True)}
        return outputs | dict(output.spec_token_ids)

    def _run(self, plan: StepPlan) -> dict[int, int]:
        self.step += 1
        output = self.runner.execute(plan)
        return dict(zip(output.request_ids, output.sampled_token_ids, strict=True))


def blocks_of(request_id: int) -> list[int]:
    return list(range(request_id * BLOCKS_PER_REQUEST, (request_id + 1) * BLOCKS_PER_REQUEST))


def run_workload(runner: ModelRunner) -> list[dict[int, int]]:
    driver = Driver(runner)
    prompts = {0: prompt(10, 5), 1: prompt(11, 9), 2: prompt(12, 14)}
    sampled = [driver.prefill([(rid, tokens, blocks_of(rid), 0) for rid, tokens in prompts.items()])]
    for _ in range(12):
        sampled.append(driver.decode([0, 1, 2]))
    # A prompt whose first block is request 0's (a prefix-cache hit): it has context to
    # attend, so a prompt graph cannot take it.
    shared = prompts[0][:BLOCK] + prompt(13, 7)
    sampled.append(driver.prefill([(3, shared, blocks_of(0)[:1] + blocks_of(3)[1:], BLOCK)]))
    for _ in range(4):
        sampled.append(driver.decode([3, 1]))
    return sampled


def capture_all(runner: ModelRunner, budget: int = 1 << 30, free_memory=lambda: 0):
    return runner.graph_runner.capture_graphs(BUCKETS, budget, 0.3, STRATEGIES, free_memory,
                                 GraphCapturer(torch.device("cpu"), emulate=True))


def test_replayed_buckets_sample_what_the_eager_path_samples(pair) -> None:
    _, model, config = pair
    eager = run_workload(make_runner(model, config))

    runner = make_runner(model, config)
    reports = capture_all(runner)
    assert [len(r.captured) for r in reports.values()] == [6, 12]
    replays = Replays(runner)
    graphed = run_workload(runner)

    assert graphed == eager
    assert replays.counts[("prompt", 4, 16)] == 1          # the three fresh prompts
    assert sum(v for (phase, *_), v in replays.counts.items() if phase == "prompt") == 1
    assert sum(v for (phase, *_), v in replays.counts.items() if phase == "decode") == 16
    # Three contexts grow from 6-15 to 17-26 tokens: buckets (4, 16), (4, 24) and (4, 32);
    # then two, the longest from 22 to 25 tokens: (2, 24) and (2, 32).
    assert {key for key in replays.counts if key[0] == "decode"} == {
        ("decode", 4, 16), ("decode", 4, 24), ("decode", 4, 32), ("decode", 2, 24),
        ("decode", 2, 32)}


VERIFY_PROMPTS = {0: prompt(10, 5), 1: prompt(11, 9), 2: prompt(12, 14)}


def greedy_tokens(model, config) -> dict[int, list[int]]:
    """Each of VERIFY_PROMPTS' requests' first 7 greedy tokens, decoded one at a time."""
    plain = Driver(make_runner(model, config))
    greedy = {rid: [token] for rid, token in plain.prefill(
        [(rid, tokens, blocks_of(rid), 0) for rid, tokens in VERIFY_PROMPTS.items()]).items()}
    for _ in range(6):
        for rid, token in plain.decode([0, 1, 2]).items():
            greedy[rid].append(token)
    return greedy


def verify_workload(runner: ModelRunner, bucketed: bool, greedy: dict[int, list[int]]
                    ) -> list[dict[int, list[int]]]:
    """Three prompts, then steps verifying proposals drawn from `greedy` (each request's
    greedy tokens), some wrong: 3 + 1, 2 + 2 and 4 rows, the decode buckets of 4 rows."""
    driver = Driver(runner)
    driver.prefill([(rid, tokens, blocks_of(rid), 0) for rid, tokens in VERIFY_PROMPTS.items()])
    known = dict.fromkeys(VERIFY_PROMPTS, 1)         # greedy tokens each request holds

    def ahead(rid: int, count: int, wrong_at: int | None = None) -> list[int]:
        tokens = greedy[rid][known[rid]:known[rid] + count]
        if wrong_at is not None:
            tokens[wrong_at] = (tokens[wrong_at] + 1) % 50
        return tokens

    outputs = []
    for step in (lambda: {0: ahead(0, 2), 1: []},
                 lambda: {0: ahead(0, 1, wrong_at=0), 2: ahead(2, 1)},
                 lambda: {1: ahead(1, 3, wrong_at=2)}):
        got = driver.verify(step(), bucketed)
        for rid, tokens in got.items():
            known[rid] += len(tokens)
        outputs.append(got)
    return outputs


def test_verify_steps_replay_decode_graphs_row_per_token(pair) -> None:
    """A request verifying k proposals as k + 1 rows of a decode bucket (each attending to its
    context up to itself) verifies, through a replayed decode graph, what the unbucketed eager
    path verifies with its rows as a prompt chunk over cached context, and both emit each
    request's greedy tokens: accepted proposals up to the first wrong one, then the model's."""
    _, model, config = pair
    greedy = greedy_tokens(model, config)
    eager = verify_workload(make_runner(model, config), False, greedy)
    runner = make_runner(model, config)
    capture_all(runner)
    replays = Replays(runner)
    graphed = verify_workload(runner, True, greedy)
    assert graphed == eager
    assert eager == [{0: greedy[0][1:4], 1: greedy[1][1:2]},
                     {0: greedy[0][4:5], 2: greedy[2][1:3]}, {1: greedy[1][2:5]}], greedy
    assert sum(v for (phase, *_), v in replays.counts.items() if phase == "decode") == 3


@needs_cpu_ops
def test_the_cpu_kernel_verifies_rows_per_token_as_the_torch_path(pair) -> None:
    """The same verify steps with decode attention through the C++ kernel (context lengths per
    row, several rows on one block table), eagerly and replayed: the torch path's tokens."""
    _, model, config = pair
    greedy = greedy_tokens(model, config)
    expected = verify_workload(make_runner(model, config), True, greedy)
    for graphs in (False, True):
        kernel = make_runner(model, config)
        kernel.attention = CPP
        if graphs:
            capture_all(kernel)
        assert verify_workload(kernel, True, greedy) == expected


@needs_cpu_ops
def test_the_cpu_kernel_samples_what_the_torch_path_samples_eager_and_replayed(pair) -> None:
    """Decode attention through the C++ kernel (one group, context lengths) instead of gathered
    context and masks: same tokens, eagerly and through emulated bucket graphs (padding rows
    read the scratch block)."""
    _, model, config = pair
    expected = run_workload(make_runner(model, config))
    kernel = make_runner(model, config)
    kernel.attention = CPP
    assert run_workload(kernel) == expected
    captured = make_runner(model, config)
    captured.attention = CPP
    capture_all(captured)
    assert run_workload(captured) == expected


def test_padding_of_a_replayed_batch_touches_no_real_block(pair) -> None:
    _, model, config = pair
    runner = make_runner(model, config)
    capture_all(runner)
    untouched = blocks_of(5)
    before = [(k.view(NUM_BLOCKS, -1)[untouched].clone(), v.view(NUM_BLOCKS, -1)[untouched].clone())
              for k, v in runner.kv_caches]
    Driver(runner).prefill([(0, prompt(20, 3), blocks_of(0), 0)])      # 1 row of 3 in (1, 8)
    Driver(runner).decode([0])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(k.view(NUM_BLOCKS, -1)[untouched], k0)
        assert torch.equal(v.view(NUM_BLOCKS, -1)[untouched], v0)


def test_a_batch_of_another_shape_is_refused_by_a_graph() -> None:
    def inputs(n: int) -> StaticInputs:
        from spmd_runtime.runtime.layers.attention import AttentionBatch
        batch = AttentionBatch(block_size=4, slot_mapping=torch.zeros(n, dtype=torch.long),
                               decodes=[], prefills=[], prompt_rows=n)
        return StaticInputs(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                            batch)

    graph = BucketGraph(inputs(8), lambda: torch.zeros(1))
    with pytest.raises(RuntimeError, match="differ from the captured"):
        graph.load(inputs(4))


def test_capture_stops_at_the_memory_budget(pair) -> None:
    _, model, config = pair
    runner = make_runner(model, config)
    free = [10_000_000]

    def free_memory() -> int:
        # Each capture takes 1,000 bytes per token of its bucket (batch size x length).
        if runner.graphs and len(runner.graphs) != free_memory.seen:
            bs, length = list(runner.graphs)[-1][1:]
            free[0] -= 1000 * bs * length
            free_memory.seen = len(runner.graphs)
        return free[0]

    free_memory.seen = 0
    reports = capture_all(runner, budget=200_000, free_memory=free_memory)
    used = sum(r.used_bytes for r in reports.values())
    assert 0 < used <= 200_000
    assert set(runner.graphs) == {(p, *b) for p, r in reports.items() for b in r.captured}
    # min_tokens for prompt: the smallest prompt buckets first.
    assert reports["prompt"].captured[:2] == [(1, 8), (1, 16)]


def test_graphs_are_cuda_only_unless_emulated() -> None:
    with pytest.raises(ValueError, match="CUDA only"):
        GraphCapturer(torch.device("cpu"))


class GraphPools:
    """The CUDA caching allocator's count of live graphs per private pool (c10's
    create_or_incref_pool and releasePool): a capture into a pool id creates the pool or counts
    one more graph into it, and refuses a pool whose count has dropped to 0, which stays listed
    while memory of it is still held; a destroyed graph counts one out."""

    def __init__(self) -> None:
        self.use_counts: dict[tuple[int, int], int] = {}
        self.handles = 0

    def handle(self) -> tuple[int, int]:
        """A new pool id, as torch.cuda.graph_pool_handle() gives."""
        self.handles += 1
        return (0, self.handles)

    def incref(self, pool: tuple[int, int]) -> None:
        if self.use_counts.get(pool, 1) <= 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED at "
                               "CUDACachingAllocator.cpp")
        self.use_counts[pool] = self.use_counts.get(pool, 0) + 1


class FakeGraph:
    def __init__(self, pools: GraphPools) -> None:
        self.pools, self.pool = pools, None

    def capture_begin(self, pool: tuple[int, int]) -> None:
        self.pools.incref(pool)
        self.pool = pool

    def replay(self) -> None:
        pass

    def __del__(self) -> None:
        if self.pool is not None:
            self.pools.use_counts[self.pool] -= 1


class FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def graph_pools(monkeypatch) -> GraphPools:
    """torch.cuda's graph capture on CPU, its pools counted by a GraphPools."""
    pools = GraphPools()

    @contextlib.contextmanager
    def graph(cuda_graph: FakeGraph, pool: tuple[int, int]):
        cuda_graph.capture_begin(pool)
        yield

    for name, value in {"graph_pool_handle": pools.handle, "CUDAGraph": lambda: FakeGraph(pools),
                        "graph": graph, "Stream": lambda device: FakeStream(),
                        "current_stream": lambda device: FakeStream(),
                        "stream": lambda stream: contextlib.nullcontext(),
                        "synchronize": lambda device: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    return pools


def test_graph_replays_batches_capture_into_a_live_pool(pair, graph_pools) -> None:
    """bench/graph_replay.py's sequence: one capturer; per batch size, capture its buckets'
    graphs, time them, drop them. The graphs of one batch share a pool; the next batch's go to
    a new pool, never to the one whose graphs are all gone (the allocator asserts on that)."""
    _, model, config = pair
    runner = make_runner(model, config)
    capturer = GraphCapturer(torch.device("cuda"))
    for batch, lengths in [(4, (16, 32)), (2, (16, 32)), (1, (32,))]:
        buckets = {Phase.DECODE: PhaseBuckets(Phase.DECODE, BucketRange(batch, batch, batch),
                                              BucketRange(min(lengths), 16, max(lengths)),
                                              tuple((batch, n) for n in lengths))}
        runner.graph_runner.capture_graphs(buckets, 1 << 50, 0.0, STRATEGIES, lambda: 0, capturer)
        assert graph_pools.use_counts[(0, graph_pools.handles)] == len(lengths)
        runner.graphs.clear()
    assert graph_pools.use_counts == {(0, 1): 0, (0, 2): 0, (0, 3): 0}


def test_a_capturer_keeps_its_pool_while_one_of_its_graphs_lives(graph_pools) -> None:
    capturer = GraphCapturer(torch.device("cuda"))
    replays = [capturer.capture(lambda: torch.zeros(4)) for _ in range(2)]
    replays.pop()
    replays.append(capturer.capture(lambda: torch.zeros(2)))
    assert graph_pools.use_counts == {(0, 1): 2}
