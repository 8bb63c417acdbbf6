"""Prefix caching end to end on smollm2: one engine with caching on and one with it off, same
token budget (64, so prompts are prefilled in chunks) and the same KV pool.

* Outputs are identical with caching on and off, token for token, and equal transformers'
  float32 greedy reference (EOS ignored on both sides, exactly NEW_TOKENS tokens).
* stats(): exact hit counts for a workload whose hits are known in advance; idle engines hold no
  blocks; reset_prefix_cache works on an idle engine and is refused while a request runs.
* A cache salt isolates prefixes: same tokens, other salt (or none) -> no hit.
"""
from __future__ import annotations

import pytest
from engine_idle import wait_idle
from spmd_runtime.runtime import LLM, Client, SamplingParams

BUDGET = 64
NUM_BLOCKS = 256
NEW_TOKENS = 12
PREFIX_LEN = 100
SUFFIX_LENS = (10, 11, 12, 13)     # prompts of 110..113 tokens; 112 is exactly 7 blocks of 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

PREFIX_TEXTS = [
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Germany and France built wooden machines that riders pushed along with their feet. Pedals "
    "arrived decades later, and with them came the tall penny-farthing, whose huge front wheel "
    "made every ride an adventure and every fall a serious one. By the end of the century the "
    "safety bicycle, with two wheels of equal size and a chain driving the rear one, had made "
    "cycling popular with workers, students and women all over Europe and America. Today "
    "millions of people ride to work every morning, and many cities build special lanes for them.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to produce glucose and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the pigment chlorophyll that gives plants "
    "their colour and absorbs most of the light they need. The glucose feeds the plant and is "
    "stored as starch, while the oxygen escapes through tiny pores called stomata, which also "
    "let carbon dioxide in and water vapour out on hot and dry summer afternoons. Without "
    "this process there would be almost no oxygen in the air for animals and people to breathe.",
    "The committee met on Tuesday to discuss the budget for next year. After a long debate "
    "about the cost of repairing the old library roof, the members agreed to postpone the new "
    "sports hall and to spend the savings on books, computers and longer opening hours for "
    "students who need a quiet place to work. The treasurer warned that heating costs would "
    "rise again in winter, and asked every department to report its expenses each month so "
    "that the committee could react quickly if the money started to run out. The next "
    "meeting was planned for the first week of March, in the large room above the town hall.",
]
SUFFIX_TEXTS = [
    " In one short sentence, the most important point of the text above is that",
    " A good title for this paragraph, written in capital letters, would be the following:",
    " Translated into simple words that a young child could understand, this means that",
    " The question a curious teacher would most likely ask the class about it is why",
]
SALT_TEXT = ("Learning a new language as an adult is difficult but rewarding. The first weeks are "
             "full of small victories, like ordering coffee or asking for directions, followed "
             "by long periods where progress seems to stop. Reading simple stories, listening to "
             "podcasts and speaking with patient friends all help a great deal, and so does a "
             "little patience with yourself on the days when nothing seems to stick.")


def make_llm(enable_prefix_caching: bool) -> LLM:
    return LLM("smollm2", dtype="float32", enable_prefix_caching=enable_prefix_caching,
               max_num_batched_tokens=BUDGET, num_kv_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def llm_on():
    with make_llm(True) as engine:
        yield engine


@pytest.fixture(scope="module")
def llm_off():
    with make_llm(False) as engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer(hf_smollm2):
    return hf_smollm2[1]


def ids(tokenizer, text: str, length: int) -> list[int]:
    token_ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    assert len(token_ids) >= length, f"text gives {len(token_ids)} tokens, need {length}"
    return token_ids[:length]


@pytest.fixture(scope="module")
def prompt_groups(tokenizer) -> list[list[list[int]]]:
    """3 groups of 4 prompts: a shared 100-token prefix, then 4 different 10..13-token suffixes."""
    groups = []
    for prefix_text in PREFIX_TEXTS:
        prefix = ids(tokenizer, prefix_text, PREFIX_LEN)
        groups.append([prefix + ids(tokenizer, suffix, n)
                       for suffix, n in zip(SUFFIX_TEXTS, SUFFIX_LENS, strict=True)])
    flat = [p for group in groups for p in group]
    assert len({tuple(p) for p in flat}) == len(flat)
    return groups




def expected_hit_tokens(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    """Tokens a prompt must hit: whole blocks shared with an earlier prompt, never the block
    holding its last token (these prompts never share a block that is not all prefix)."""
    common = max((next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b),
                        min(len(prompt), len(other))) for other in earlier), default=0)
    return min(common // block_size, (len(prompt) - 1) // block_size) * block_size


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompts, params)
    return [list(o.token_ids) for o in outputs]


@pytest.fixture(scope="module")
def workload(llm_on, llm_off, prompt_groups):
    """The same two waves on both engines; outputs and stats before/after each wave.

    wave 1: the first two prompts of group 0 and the first prompt of groups 1 and 2, in one
      batch. The budget (64) cannot hold group 0's first prompt (110 tokens), so its second
      prompt is admitted in a later step, after a hit on the chunk(s) already computed;
    wave 2: the other 8 prompts; each hits exactly its group's 96-token prefix (6 blocks).
    """
    groups = prompt_groups
    waves = [[groups[0][0], groups[0][1], groups[1][0], groups[2][0]],
             [groups[0][2], groups[0][3]] + groups[1][1:] + groups[2][1:]]
    result = {}
    for name, llm in (("on", llm_on), ("off", llm_off)):
        stats = [llm.client.stats()]
        outputs = []
        for wave in waves:
            outputs.append(run(llm, wave))
            stats.append(wait_idle(llm.client))
        result[name] = {"outputs": outputs, "stats": stats}
    result["waves"] = waves
    return result


# ---------------------------------------------------------------------------- correctness

def test_outputs_identical_with_prefix_caching_on_and_off(workload) -> None:
    for index, (on, off) in enumerate(zip(workload["on"]["outputs"], workload["off"]["outputs"],
                                          strict=True)):
        assert len(on) == len(workload["waves"][index])
        for prompt_index, (a, b) in enumerate(zip(on, off, strict=True)):
            assert len(a) == NEW_TOKENS
            assert a == b, (f"wave {index} prompt {prompt_index}: caching on {a}, off {b}")


def test_outputs_match_transformers_greedy(workload, prompt_groups, hf_smollm2,
                                           greedy_reference) -> None:
    model, _ = hf_smollm2
    # Group 0's first prompt (computed whole), its second one (a hit on the first one's chunks
    # in the same batch) and its third one (admitted after a 96-token hit).
    prompts = prompt_groups[0][:3]
    ours = workload["on"]["outputs"][0][:2] + workload["on"]["outputs"][1][:1]
    refs = [greedy_reference.generate(model, p, NEW_TOKENS) for p in prompts]
    greedy_reference.check(model, prompts, ours, refs, min_exact=len(prompts))


# ---------------------------------------------------------------------------- stats

def test_stats_count_the_expected_hits(workload, llm_on) -> None:
    block_size = llm_on.client.model_info().block_size
    assert block_size == 16
    waves = workload["waves"]
    stats = workload["on"]["stats"]
    assert all(s.prefix_caching for s in stats)
    pairs = list(zip(stats, stats[1:], strict=False))
    queries = [b.prefix_cache_queries - a.prefix_cache_queries for a, b in pairs]
    hits = [b.prefix_cache_hits - a.prefix_cache_hits for a, b in pairs]
    assert queries == [sum(len(p) for p in wave) for wave in waves]

    # Wave 1: only group 0's second prompt hits: the first chunk (64 tokens) or more of the
    # first prompt, and never the block holding the 4 last prefix tokens and its own suffix.
    assert BUDGET <= hits[0] <= (PREFIX_LEN // block_size) * block_size
    assert hits[0] % block_size == 0
    expected = sum(expected_hit_tokens(p, waves[0], block_size) for p in waves[1])
    assert expected == 8 * (PREFIX_LEN // block_size) * block_size
    assert hits[1] == expected, f"wave 2: {hits[1]} hit tokens, expected {expected}"

    total_queries = stats[-1].prefix_cache_queries - stats[0].prefix_cache_queries
    total_hits = stats[-1].prefix_cache_hits - stats[0].prefix_cache_hits
    assert total_hits / total_queries > 0.3
    last = stats[-1]
    assert last.prefix_cache_hit_rate == pytest.approx(last.prefix_cache_hits
                                                      / last.prefix_cache_queries)
    assert last.prefix_cache_hit_rate > 0.3
    assert last.kv_blocks_cached > 0


def test_stats_of_the_engine_without_prefix_caching(workload, llm_off) -> None:
    for stats in workload["off"]["stats"] + [llm_off.client.stats()]:
        assert stats.prefix_caching is False
        assert stats.prefix_cache_hits == 0 and stats.prefix_cache_hit_rate == 0.0
        assert stats.kv_blocks_cached == 0


def test_idle_engines_hold_no_blocks(workload, llm_on, llm_off) -> None:
    for name, llm in (("on", llm_on), ("off", llm_off)):
        for stats in workload[name]["stats"] + [wait_idle(llm.client)]:
            assert stats.kv_blocks_total == NUM_BLOCKS
            assert stats.kv_blocks_free == stats.kv_blocks_total, (name, stats)
            assert stats.kv_blocks_in_use == 0, (name, stats)
        assert stats.maintenance_hidden_ms <= stats.maintenance_ms + 1e-6


# ---------------------------------------------------------------------------- salt

def test_cache_salt_isolates_prefixes(llm_on, tokenizer) -> None:
    client = llm_on.client
    block_size = client.model_info().block_size
    # Exactly 3 blocks: a full hit is 2 blocks, the block holding the last token is recomputed.
    prompt = ids(tokenizer, SALT_TEXT, 3 * block_size)
    full_hit = 2 * block_size

    def send(salt):
        before = wait_idle(client)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt=salt)
        (output,) = run(llm_on, [prompt], params)
        after = wait_idle(client)
        assert after.prefix_cache_queries - before.prefix_cache_queries == len(prompt)
        return after.prefix_cache_hits - before.prefix_cache_hits, output

    unsalted_hits, expected_output = send(None)
    assert unsalted_hits == 0, "the salt prompt must be new to the engine"
    hits, output = send("tenant-a")
    assert hits == 0, "a salted request hit blocks cached without its salt"
    assert output == expected_output
    hits, output = send("tenant-a")
    assert hits == full_hit, "a second request with the same salt must hit"
    assert output == expected_output
    hits, _ = send("tenant-b")
    assert hits == 0, "a request with another salt hit tenant-a's blocks"
    hits, output = send(None)
    assert hits == full_hit, "the unsalted prefix should still be cached"
    assert output == expected_output


# ---------------------------------------------------------------------------- reset

def test_reset_prefix_cache_on_an_idle_engine(workload, llm_on, llm_off, prompt_groups) -> None:
    client = llm_on.client
    prompt = prompt_groups[0][0]
    run(llm_on, [prompt])
    before = wait_idle(client)
    assert before.kv_blocks_cached > 0
    client.reset_prefix_cache()
    after = client.stats()
    assert after.kv_blocks_cached == 0
    assert after.kv_blocks_free == after.kv_blocks_total
    # The prompt that was cached is a miss now, and the same output comes back.
    output = run(llm_on, [prompt])
    again = wait_idle(client)
    assert again.prefix_cache_hits == after.prefix_cache_hits
    assert output == [workload["on"]["outputs"][0][0]]
    assert again.kv_blocks_cached > 0
    # Resetting an engine without prefix caching is harmless.
    llm_off.client.reset_prefix_cache()
    assert llm_off.client.stats().kv_blocks_cached == 0


def test_reset_prefix_cache_is_refused_while_a_request_runs(llm_on, prompt_groups) -> None:
    client = llm_on.client
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    stream = client.stream(prompt_groups[1][0], params)
    try:
        first = next(stream)
        assert first.finish_reason is None and first.token_ids
        with Client(llm_on.config.rpc_address) as other:
            busy = other.stats()
            assert busy.kv_blocks_in_use > 0
            with pytest.raises(ValueError, match="in use"):
                other.reset_prefix_cache()
            still = other.stats()
            assert still.kv_blocks_cached > 0, "a refused reset must not drop cached blocks"
    finally:
        stream.close()                     # aborts the request
    idle = wait_idle(client)
    assert idle.kv_blocks_free == idle.kv_blocks_total and idle.kv_blocks_in_use == 0
    client.reset_prefix_cache()
    assert client.stats().kv_blocks_cached == 0


# ---------------------------------------------------------------------------- worker level

def nan_filled_empty(real_empty):
    """torch.empty as its contract allows: the memory may hold anything, here NaN."""
    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor
    return empty


@pytest.fixture(scope="module")
def model_runner():
    """The worker's ModelRunner for smollm2 in this process (8 KV blocks), no engine around it,
    in float32: its tests assert that a hit samples exactly what a full prefill does, which bf16
    does not promise (a prompt's rows and a hit's few take different product paths there).

    Its KV cache is allocated by the worker's own allocate_kv_cache, with torch.empty returning
    NaN-filled memory -- what a reused heap chunk may hold (seen in engines under test).
    """
    import spmd_runtime.worker_proc.kv_cache as kv_cache
    import spmd_runtime.worker_proc.worker as worker
    import torch
    from spmd_runtime.protocol.config import EngineConfig
    from spmd_runtime.worker_proc.distributed import DistributedContext

    real_allocate = kv_cache.allocate_kv_cache

    def allocate_from_dirty_memory(*args, **kwargs):
        real_empty = torch.empty
        torch.empty = nan_filled_empty(real_empty)
        try:
            return real_allocate(*args, **kwargs)
        finally:
            torch.empty = real_empty

    config = EngineConfig(model="smollm2", device="cpu", num_kv_blocks=8, max_model_len=128,
                          dtype="float32")
    context = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                                 backend="gloo")
    with pytest.MonkeyPatch.context() as patch:
        # The pool's allocation (kv_cache.allocate_pools calls its module's allocate_kv_cache).
        patch.setattr(kv_cache, "allocate_kv_cache", allocate_from_dirty_memory)
        runner, _ = worker.build_runner(config, context)
    return runner


def run_plans_with_a_hit(runner, prompt: list[int], fill: float | None = None) -> list[int]:
    """Request 1 computes `prompt` (block 1 full, block 2 partial) and decodes 3 tokens; request 2
    has the same prompt and is admitted after a hit on block 1, computing the rest into block 5.
    With `fill`, every KV slot is set to it first."""
    from spmd_runtime.protocol.messages import NewRequestData, StepPlan

    if fill is not None:
        for keys, values in runner.kv_caches:
            keys.fill_(fill)
            values.fill_(fill)
    block_size = runner.block_size
    assert block_size < len(prompt) < 2 * block_size - 3
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def step(step_id, new=(), cached=(), dropped=()):
        plan = StepPlan(step_id=step_id, new_requests=list(new),
                        cached_request_ids=[rid for rid, _ in cached],
                        cached_num_scheduled_tokens=[n for _, n in cached],
                        cached_new_block_ids=[[] for _ in cached],
                        dropped_request_ids=list(dropped))
        return runner.execute(plan).sampled_token_ids

    step(-1, dropped=list(runner.requests))     # the requests of an earlier run
    tokens = step(0, new=[NewRequestData(1, list(prompt), [1, 2], 0, len(prompt), params)])
    for step_id in range(1, 4):
        tokens += step(step_id, cached=[(1, 1)])
    tokens += step(4, new=[NewRequestData(2, list(prompt), [1, 5], block_size,
                                          len(prompt) - block_size, params)])
    tokens += step(5, cached=[(2, 1)])
    return tokens


def test_hits_and_decodes_ignore_never_written_kv_slots(model_runner, prompt_groups) -> None:
    """Context is gathered whole blocks at a time, so the never-written tail of a request's last
    block is read (and masked) by decodes and by a prefill after a hit. Whatever the freshly
    allocated cache holds there must not change a token: 0 * NaN is NaN under the mask."""
    prompt = prompt_groups[0][0][:20]
    fresh = run_plans_with_a_hit(model_runner, prompt)             # the cache as allocated
    clean = run_plans_with_a_hit(model_runner, prompt, fill=0.0)
    assert clean[4] == clean[0], "a request admitted after a hit must sample what a full prefill did"
    assert clean[5] == clean[1]
    assert fresh == clean, (
        f"never-written KV slots changed the output: {fresh} on the freshly allocated cache, "
        f"{clean} on a zeroed one")
