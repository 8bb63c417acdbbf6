"""Memory pressure end to end on smollm2 (float32, greedy, EOS ignored).

32 requests (16-48 prompt tokens, 16-24 new tokens: up to 5 blocks of 16 each, 123 blocks in
all) run once on a roomy pool (512 blocks, no preemption) and then on a pool of 32 blocks with
no admission watermark, so running requests keep outgrowing the pool and the newest is
preempted over and over:

* swapped out to a CPU swap space big enough for every victim, under both schedulers;
* soft reset (recomputed later) with no swap space, under both schedulers;
* with a swap space of 4 blocks, so some victims are swapped and others soft reset.

Every pressure run must give the roomy run's outputs token for token (same engine, float32),
and the roomy run must agree with transformers' greedy reference. stats() must count the
swaps out/in and soft resets, and show the device and CPU pools fully free once idle.

On the small-swap engine, a prompt that could never fit in the whole KV cache is refused at
admission with an error naming the KV cache, among normal requests that still complete (as
does one that needs the whole pool); and requests aborted while running, swapped out, soft
reset or waiting leave no device or CPU block behind.

Six engine starts in all (~2 minutes on 2 cores); the roomy run is a module fixture.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import msgspec
import pytest
from engine_idle import wait_idle
from raw_socket import RawSocket
from spmd_runtime.protocol.messages import (
    AbortDone,
    AbortRequest,
    AddRequest,
    ErrorReply,
    Outputs,
    RequestAccepted,
)
from spmd_runtime.runtime import LLM, SamplingParams

BLOCK = 16
ROOMY_BLOCKS = 512
PRESSURE_BLOCKS = 32
BUDGET = 128
# smollm2 in float32: K and V x 30 layers x 16 slots x 3 KV heads x 64 dims x 4 bytes.
BLOCK_BYTES = 2 * 30 * BLOCK * 3 * 64 * 4
ROOMY_SWAP_BYTES = int(0.05 * 2**30)           # 72 CPU blocks: more than the device pool
SMALL_SWAP_BLOCKS = 4
SMALL_SWAP_BYTES = SMALL_SWAP_BLOCKS * BLOCK_BYTES
NUM_REQUESTS = 32
TEXT_PROMPT_LEN = 40
MAX_NEW_TOKENS = 24

TEXTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can "
    "of oil and a cloth to polish the great lens, while the wind rattled the windows and the "
    "sea threw spray against the rocks far below.",
    "Bees communicate the direction and distance of flowers to the rest of the hive with a "
    "dance. The angle of the dance shows the direction relative to the sun, and its length "
    "tells the others how far they will have to fly.",
    "In the small village market on Saturday mornings, farmers sell fresh eggs, cheese, honey "
    "and vegetables from the surrounding hills, and the baker opens early so that the smell "
    "of warm bread fills the whole square before eight o'clock.",
    "A computer program is a sequence of instructions that tells the machine what to do. "
    "Programmers write these instructions in a programming language, which a compiler or an "
    "interpreter then translates into operations the processor can execute.",
    "The river flooded twice that spring, covering the low fields with brown water and mud. "
    "When it finally went down, the farmers found that the soil was richer than ever, and the "
    "summer harvest turned out to be the best in many years.",
    "Mountain climbers usually start their final climb to the summit long before sunrise, "
    "when the snow is still frozen hard and the risk of avalanches is lower, so that they can "
    "reach the top and come back down before the afternoon storms.",
]


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]
    text_indices: list[int]        # prompts of real text, all TEXT_PROMPT_LEN tokens long


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(hf_smollm2) -> Workload:
    """24 random-token prompts and 8 real-text ones, interleaved. Two text prompts share their
    first 2 blocks with earlier ones (prefix-cache hits, at least in the roomy run)."""
    tokenizer = hf_smollm2[1]
    texts = [list(tokenizer(text).input_ids) for text in TEXTS]
    assert all(len(t) >= TEXT_PROMPT_LEN for t in texts)
    text_prompts = [t[:TEXT_PROMPT_LEN] for t in texts]
    text_prompts.append(texts[0][:32] + texts[2][:TEXT_PROMPT_LEN - 32])
    text_prompts.append(texts[1][:32] + texts[3][:TEXT_PROMPT_LEN - 32])
    rng = random.Random(20240611)
    text_at = {1: 0, 5: 1, 9: 2, 13: 3, 17: 4, 21: 5, 26: 6, 30: 7}
    prompts, params = [], []
    for index in range(NUM_REQUESTS):
        if index in text_at:
            prompts.append(text_prompts[text_at[index]])
        else:
            prompts.append([rng.randrange(1000, 40000) for _ in range(rng.randint(16, 48))])
        params.append(greedy(rng.randint(16, MAX_NEW_TOKENS)))
    return Workload(prompts, params, sorted(text_at))


@dataclass
class Run:
    tokens: list[list[int]]
    finish_reasons: list[str | None]
    delta: dict[str, int]           # counters of stats() over the run
    idle: object                    # stats() once idle


COUNTERS = ("num_preemptions", "num_swaps_out", "num_swaps_in", "num_soft_resets",
            "num_finished", "num_generated_tokens", "num_prompt_tokens", "prefix_cache_hits")


def run_workload(llm: LLM, work: Workload) -> Run:
    before = llm.client.stats()
    outputs = llm.generate(work.prompts, work.params)
    idle = wait_idle(llm.client)
    delta = {name: getattr(idle, name) - getattr(before, name) for name in COUNTERS}
    return Run([o.token_ids for o in outputs], [o.finish_reason for o in outputs], delta, idle)


@pytest.fixture(scope="module")
def roomy(workload) -> Run:
    with LLM("smollm2", dtype="float32", num_kv_blocks=ROOMY_BLOCKS, max_num_batched_tokens=BUDGET) as llm:
        return run_workload(llm, workload)


class Engines:
    """One pressure engine at a time, kept for the next test that asks for the same options."""

    def __init__(self) -> None:
        self.options: dict | None = None
        self.llm: LLM | None = None

    def get(self, **options) -> LLM:
        if options != self.options:
            self.close()
            self.llm = LLM("smollm2", dtype="float32", num_kv_blocks=PRESSURE_BLOCKS,
                           max_num_batched_tokens=BUDGET,
                           kv_admission_watermark=0.0, **options)
            self.options = options
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
        self.llm = self.options = None


@pytest.fixture(scope="module")
def engines():
    pool = Engines()
    try:
        yield pool
    finally:
        pool.close()


def assert_idle_and_free(stats, cpu_blocks: int) -> None:
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0, stats
    assert stats.num_preempted == 0, stats
    assert stats.kv_blocks_total == PRESSURE_BLOCKS, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.kv_blocks_in_use == 0, (
        f"leaked device blocks: {stats}")
    assert stats.cpu_kv_blocks_total == cpu_blocks, stats
    assert stats.cpu_kv_blocks_free == stats.cpu_kv_blocks_total, f"leaked CPU blocks: {stats}"


def assert_same_outputs(run: Run, reference: Run, what: str) -> None:
    differ = [i for i, (a, b) in enumerate(zip(run.tokens, reference.tokens, strict=True))
              if a != b]
    assert not differ, (f"{what}: requests {differ} differ from the roomy run, first: "
                        f"{run.tokens[differ[0]]} vs {reference.tokens[differ[0]]}")
    assert all(reason == "length" for reason in run.finish_reasons), run.finish_reasons


# ---------------------------------------------------------------------------- the roomy run

@pytest.mark.timeout(400)
def test_roomy_run_matches_transformers(roomy, workload, hf_smollm2, greedy_reference) -> None:
    model, _ = hf_smollm2
    assert roomy.delta["num_preemptions"] == 0, "the roomy pool must not preempt"
    assert roomy.delta["num_finished"] == NUM_REQUESTS
    for tokens, params, reason in zip(roomy.tokens, workload.params, roomy.finish_reasons,
                                      strict=True):
        assert len(tokens) == params.max_tokens and reason == "length"
    assert roomy.idle.kv_blocks_in_use == 0 and roomy.idle.cpu_kv_blocks_total == 0
    assert roomy.delta["prefix_cache_hits"] == 2 * 32, "the two shared 32-token prefixes"
    prompts = [workload.prompts[i] for i in workload.text_indices]
    refs = greedy_reference.generate_batch(model, prompts, MAX_NEW_TOKENS)
    ours = [roomy.tokens[i] for i in workload.text_indices]
    refs = [ref[:len(mine)] for ref, mine in zip(refs, ours, strict=True)]
    greedy_reference.check(model, prompts, ours, refs, min_exact=len(prompts) - 2)


# ---------------------------------------------------------------------------- under pressure

@pytest.mark.timeout(400)
@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
@pytest.mark.parametrize("preemption", ["swap", "soft_reset"])
def test_preempted_requests_complete_with_the_roomy_outputs(engines, workload, roomy, preemption,
                                                            scheduler) -> None:
    swap = ROOMY_SWAP_BYTES if preemption == "swap" else 0
    llm = engines.get(kv_swap_memory=swap, scheduler=scheduler)
    run = run_workload(llm, workload)
    assert_same_outputs(run, roomy, f"{preemption}/{scheduler}")
    delta = run.delta
    assert delta["num_finished"] == NUM_REQUESTS
    assert delta["num_generated_tokens"] == sum(p.max_tokens for p in workload.params), (
        "a preempted request must not sample its tokens twice")
    assert delta["num_preemptions"] == delta["num_swaps_out"] + delta["num_soft_resets"]
    assert run.idle.scheduler == scheduler
    if preemption == "swap":
        # 72 CPU blocks hold whatever the 32-block device pool can offload: never a reset.
        assert delta["num_swaps_out"] > 0, f"no preemption happened: {delta}"
        assert delta["num_swaps_in"] == delta["num_swaps_out"], delta
        assert delta["num_soft_resets"] == 0, delta
        assert_idle_and_free(run.idle, ROOMY_SWAP_BYTES // BLOCK_BYTES)
    else:
        assert delta["num_soft_resets"] > 0, f"no preemption happened: {delta}"
        assert delta["num_swaps_out"] == delta["num_swaps_in"] == 0, delta
        assert_idle_and_free(run.idle, 0)


@pytest.mark.timeout(400)
def test_small_swap_space_swaps_some_victims_and_resets_the_others(engines, workload,
                                                                   roomy) -> None:
    llm = engines.get(kv_swap_memory=SMALL_SWAP_BYTES, scheduler="fifo")
    run = run_workload(llm, workload)
    assert_same_outputs(run, roomy, "small swap space")
    delta = run.delta
    assert delta["num_swaps_out"] > 0 and delta["num_soft_resets"] > 0, delta
    assert delta["num_swaps_in"] == delta["num_swaps_out"], delta
    assert delta["num_preemptions"] == delta["num_swaps_out"] + delta["num_soft_resets"]
    assert delta["num_generated_tokens"] == sum(p.max_tokens for p in workload.params)
    assert_idle_and_free(run.idle, SMALL_SWAP_BLOCKS)


# ---------------------------------------------------------------------------- refusal

class RawClient(RawSocket):
    """Requests sent back to back (as one frame each, in order), everything that comes back
    filed."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.replies: dict[int, object] = {}       # by tag
        self.tokens: dict[int, list[int]] = {}     # by request id
        self.finished: dict[int, str] = {}         # by request id: finish reason

    def add_all(self, requests: list[tuple[list[int], SamplingParams]]) -> None:
        """AddRequest tags are the indices in `requests`."""
        for tag, (prompt, params) in enumerate(requests):
            self.send(msgspec.msgpack.encode(AddRequest(tag=tag, prompt_token_ids=prompt,
                                                        params=params)))

    def receive(self, timeout_ms: int = 1000):
        """File the next message and return it (None if nothing came)."""
        if not self.sock.poll(timeout_ms):
            return None
        message = self.decoder.decode(self.sock.recv())
        if isinstance(message, Outputs):
            for delta in message.deltas:
                self.tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
                if delta.finish_reason is not None:
                    self.finished[delta.request_id] = delta.finish_reason
        else:
            assert message.tag is not None, message
            self.replies[message.tag] = message
        return message

    def accepted(self) -> dict[int, int]:
        """tag -> request id of every accepted AddRequest."""
        return {tag: r.request_id for tag, r in self.replies.items()
                if isinstance(r, RequestAccepted)}

    def all_done(self, num_replies: int) -> bool:
        return len(self.replies) == num_replies and all(
            r in self.finished for r in self.accepted().values())



def run_raw(address: str, requests: list[tuple[list[int], SamplingParams]],
            timeout_s: float = 180.0) -> RawClient:
    client = RawClient(address)
    try:
        client.add_all(requests)
        deadline = time.monotonic() + timeout_s
        while not client.all_done(len(requests)):
            assert time.monotonic() < deadline, (
                f"stuck: replies {client.replies}, finished {sorted(client.finished)}")
            client.receive()
    finally:
        client.close()
    return client


@pytest.mark.timeout(400)
def test_prompt_that_can_never_fit_is_refused_and_does_not_wedge_the_queue(
        engines, workload, roomy) -> None:
    """Runs after the small-swap test, on its engine (32 blocks = 512 tokens)."""
    llm = engines.get(kv_swap_memory=SMALL_SWAP_BYTES, scheduler="fifo")
    cache_tokens = PRESSURE_BLOCKS * BLOCK
    rng = random.Random(7)
    too_long = [rng.randrange(1000, 40000) for _ in range(cache_tokens)]      # 32 blocks + 1 slot
    far_too_long = [rng.randrange(1000, 40000) for _ in range(cache_tokens + 200)]
    just_fits = [rng.randrange(1000, 40000) for _ in range(cache_tokens - 1)]  # the whole pool
    normal = list(range(12))
    requests = [(workload.prompts[i], workload.params[i]) for i in normal[:4]]
    requests.append((too_long, greedy(8)))
    requests += [(workload.prompts[i], workload.params[i]) for i in normal[4:8]]
    requests.append((far_too_long, greedy(8)))
    requests.append((just_fits, greedy(1)))
    requests += [(workload.prompts[i], workload.params[i]) for i in normal[8:]]
    refused_tags = {4, 9}
    client = run_raw(llm.config.rpc_address, requests)
    replies, tokens, finished = client.replies, client.tokens, client.finished

    for tag in refused_tags:
        reply = replies[tag]
        assert isinstance(reply, ErrorReply), reply
        assert "KV cache" in reply.message and str(len(requests[tag][0])) in reply.message, reply
    accepted = {tag: r.request_id for tag, r in replies.items() if tag not in refused_tags}
    assert all(isinstance(replies[tag], RequestAccepted) for tag in accepted), replies
    normal_tags = [tag for tag in range(len(requests)) if tag not in refused_tags | {10}]
    assert len(normal_tags) == len(normal)
    for tag, index in zip(normal_tags, normal, strict=True):
        request_id = accepted[tag]
        assert finished[request_id] == "length"
        assert tokens[request_id] == roomy.tokens[index], f"request {index} differs from roomy"
    boundary = accepted[10]
    assert finished[boundary] == "length" and len(tokens[boundary]) == 1
    assert_idle_and_free(wait_idle(llm.client), SMALL_SWAP_BLOCKS)

    # Through the client API: a ValueError naming the KV cache; the batch's other prompts are
    # withdrawn and the engine serves the next call.
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([workload.prompts[0], too_long], [workload.params[0], greedy(4)])
    assert_idle_and_free(wait_idle(llm.client), SMALL_SWAP_BLOCKS)
    outputs = llm.generate(workload.prompts[:3], workload.params[:3])
    assert [o.token_ids for o in outputs] == roomy.tokens[:3]
    assert_idle_and_free(wait_idle(llm.client), SMALL_SWAP_BLOCKS)


@pytest.mark.timeout(400)
def test_aborts_under_pressure_leave_no_block_behind(engines, workload, roomy) -> None:
    """Requests are aborted while the small-swap engine is under pressure: preempted ones
    (swapped out or soft reset: they got tokens before, but none in the latest step) as soon as
    they are seen, and a few that never started. The others complete with the roomy outputs,
    and no device or CPU block stays taken."""
    llm = engines.get(kv_swap_memory=SMALL_SWAP_BYTES, scheduler="fifo")
    before = llm.client.stats()
    requests = list(zip(workload.prompts, workload.params, strict=True))
    aborted: dict[int, int] = {}        # request id -> index in the workload
    num_preempted_aborts = 0
    client = RawClient(llm.config.rpc_address)
    try:
        client.add_all(requests)
        deadline = time.monotonic() + 180
        steps = 0
        while not client.all_done(len(requests) + len(aborted)):
            assert time.monotonic() < deadline, f"stuck: {client.replies}, {client.finished}"
            message = client.receive()
            # One frame per step; an abort's own final delta comes in a frame of its own.
            if not isinstance(message, Outputs) or all(
                    d.finish_reason == "abort" for d in message.deltas):
                continue
            steps += 1
            index_of = {rid: index for index, rid in client.accepted().items()}
            in_step = {d.request_id for d in message.deltas}
            preempted = [rid for rid, tokens in client.tokens.items()
                         if tokens and rid not in in_step and rid not in client.finished
                         and rid not in aborted]
            never_started = [rid for rid in index_of if rid not in client.tokens
                             and rid not in aborted]
            victim = None
            if preempted and num_preempted_aborts < 6:
                victim = preempted[0]
                num_preempted_aborts += 1
            elif never_started and steps % 10 == 0 and len(aborted) < 10:
                victim = never_started[-1]
            if victim is not None:
                aborted[victim] = index_of[victim]
                client.send(msgspec.msgpack.encode(
                    AbortRequest(tag=1000 + index_of[victim], request_id=victim)))
    finally:
        client.close()
    assert num_preempted_aborts > 0, "no preempted request was seen to abort"
    for index, request_id in client.accepted().items():
        tokens, reason = client.tokens.get(request_id, []), client.finished[request_id]
        if request_id in aborted:
            assert reason == "abort", (index, reason)
            assert isinstance(client.replies[1000 + index], AbortDone)
            assert tokens == roomy.tokens[index][:len(tokens)], f"request {index} before its abort"
        else:
            assert reason == "length", (index, reason)
            assert tokens == roomy.tokens[index], f"request {index} differs from the roomy run"
    idle = wait_idle(llm.client)
    assert_idle_and_free(idle, SMALL_SWAP_BLOCKS)
    assert idle.num_finished - before.num_finished == len(requests)
