"""Speculative decoding end to end (n-gram prompt lookup, and a draft model): greedy outputs
token for token those of the same engine without it, through chunked prefill (a budget of 16
tokens), prefix caching and preemption (a pool too small for the batch), with stop strings,
max_tokens, penalties and logprobs; smollm2 drafting for itself; over ten prompts (the parity
prompts of test_llm_correctness and two whose answers repeat them), at one rank, and at two
(smollm2's heads split unequally) by prompt lookup and by drafting for itself; under TP=2 too,
a tiny random draft for a tiny random target of smollm2's vocabulary on the same prompts, and
prompt lookup on a tiny Llama whose outputs repeat; stats() counting the proposals.
Everything here is float32.

Two smollm2 engines, the same but for --speculative, are shared by the module's tests; the
distribution kept by sampled verification is tested without an engine, in
tests/worker_proc/test_speculative.py.
"""
from __future__ import annotations

import pytest
import torch
from engine_idle import wait_idle
from sharp_llama import FAMILY_ENGINE, SMOLLM2_VOCAB, sharp_chat_llama, sharp_llama
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime import LLM, SamplingParams
from test_llm_correctness import CHAT_QUESTIONS, RAW_PROMPTS

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Chunks of 16 tokens and a pool of 24 blocks of 16 for ten requests that need ~45 together:
# preemption; the chat prompts find their system prompt's block cached. Every request may
# speculate (the batch never exceeds 16).
ENGINE = dict(dtype="float32", quantization="none", max_num_batched_tokens=16, num_kv_blocks=24,
              kv_admission_watermark=0.0, enable_prefix_caching=True)
SPECULATIVE = dict(speculative="ngram", num_speculative_tokens=4,
                   speculative_disable_by_batch_size=16)
# Outputs that repeat their prompt: where prompt lookup proposes, and proposals are accepted.
PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the "
           "committee approved the new budget for the library, the park and the school.")
REPEAT_QUESTIONS = [f"Repeat this text exactly:\n\n{PASSAGE}",
                    f"Copy this sentence twice: {PASSAGE.split('. ')[0]}."]


@pytest.fixture(scope="module")
def prompts(hf_smollm2_tokenizer) -> list[list[int]]:
    """The parity prompts of test_llm_correctness, then two whose answers repeat them."""
    tokenizer = hf_smollm2_tokenizer
    chats = []
    for question in CHAT_QUESTIONS + REPEAT_QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
        chats.append(list(tokenizer(text, add_special_tokens=False).input_ids))
    raw = [list(tokenizer(text).input_ids) for text in RAW_PROMPTS]
    return chats[:3] + raw + chats[3:]


@pytest.fixture(scope="module")
def plain():
    with LLM("smollm2", **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def speculating():
    with LLM("smollm2", **ENGINE, **SPECULATIVE) as llm:
        yield llm


def tokens_and_reasons(llm: LLM, prompts, params) -> list[tuple[list[int], str | None]]:
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def expected(plain, prompts) -> list[tuple[list[int], str | None]]:
    """The engine without speculation's greedy outputs of the ten prompts (which equal
    transformers', test_llm_correctness)."""
    return tokens_and_reasons(plain, prompts, GREEDY)


@pytest.mark.timeout(600)
def test_greedy_outputs_equal_speculation_off(expected, speculating, prompts) -> None:
    """float32 greedy over ten prompts (the chat ones share their system prompt's block in the
    prefix cache), with chunks of 16 tokens and preemption: token for token the engine without
    speculation's;
    stats() counts proposals and accepted tokens (the repeating prompts accept most)."""
    before = speculating.client.stats()
    assert tokens_and_reasons(speculating, prompts, GREEDY) == expected
    stats = wait_idle(speculating.client)
    assert stats.speculative == "ngram"
    assert stats.num_preemptions > before.num_preemptions, "the pool should have been too small"
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    drafts = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafts > 0 and accepted > 0, stats
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert stats.kv_blocks_in_use == 0, "blocks of rejected proposals must be freed with the request"
    assert "ngram:" in str(stats)


@pytest.mark.timeout(300)
def test_stop_strings_and_max_tokens_end_where_token_by_token_decoding_ends(
        plain, speculating, prompts) -> None:
    """float32 greedy on the repeating prompts: a stop string met inside a verified run of
    tokens, and max_tokens inside one, end the output where decoding one token at a time ends
    it (tokens and text)."""
    repeating = prompts[-2:]
    cases = [SamplingParams(max_tokens=40, temperature=0.0, stop=("library",)),
             SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)]
    for params in cases:
        want = plain.generate(repeating, params)
        got = speculating.generate(repeating, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
            [(o.token_ids, o.text, o.finish_reason) for o in want], params


@pytest.mark.timeout(300)
def test_requests_with_penalties_or_logprobs_speculate(plain, speculating, prompts) -> None:
    """float32 greedy: requests with penalties (each proposal's row counting the proposals
    before it) and with logprobs (a record per emitted token, read at its row) speculate, and
    give the engine without speculation's tokens and log-probabilities (within 1e-4), one record
    per token where max_tokens cuts a verified run."""
    repeating = prompts[-2:] * 2
    params = [SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3),
              SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=0.5,
                             frequency_penalty=0.3, logprobs=1),
              SamplingParams(max_tokens=15, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=17, temperature=0.0, logprobs=0)]
    before = wait_idle(speculating.client).spec_decode_num_drafts
    got = speculating.generate(repeating, params)
    want = plain.generate(repeating, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for mine, theirs in zip(got[1:], want[1:], strict=True):
        assert len(mine.logprobs) == len(mine.token_ids)
        assert [r.token_ids for r in mine.logprobs] == [r.token_ids for r in theirs.logprobs]
        # Prefix-cache hits left by earlier tests differ between the engines: the same values
        # up to float32 summation order.
        torch.testing.assert_close([r.logprobs for r in mine.logprobs],
                                   [r.logprobs for r in theirs.logprobs], rtol=0, atol=1e-4)
    assert wait_idle(speculating.client).spec_decode_num_drafts > before


@pytest.mark.timeout(300)
def test_constrained_requests_speculate_within_their_grammar(plain, speculating, prompts) -> None:
    """float32 greedy under a grammar: n-gram proposals cut at the first token the grammar
    refuses, a mask per row of the rest, and the engine without speculation's outputs. The
    passage's own words pass the first regex (proposals accepted); the second refuses the
    comma the passage goes on with (proposals cut there), and a choice ends the third early."""
    assert_constrained_outputs_equal(speculating, plain, prompts)


def assert_constrained_outputs_equal(speculating: LLM, plain: LLM, prompts) -> None:
    """The three constrained requests of test_constrained_requests_speculate_within_their_
    grammar give `plain`'s outputs on `speculating`, which counts drafts."""
    from spmd_runtime.protocol.sampling import StructuredOutput

    repeating = prompts[-2:] + prompts[-2:-1]
    params = [SamplingParams(max_tokens=24, temperature=0.0,
                             structured_output=StructuredOutput(regex=r"[A-Za-z ,.\n]+")),
              SamplingParams(max_tokens=24, temperature=0.0,
                             structured_output=StructuredOutput(regex=r"[A-Za-z .]+")),
              SamplingParams(max_tokens=24, temperature=0.0,
                             structured_output=StructuredOutput(choice=("The committee met",
                                                                        "No")))]
    before = wait_idle(speculating.client).spec_decode_num_drafts
    got = speculating.generate(repeating, params)
    want = plain.generate(repeating, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want]
    assert got[2].text in ("The committee met", "No")
    assert wait_idle(speculating.client).spec_decode_num_drafts > before


@pytest.mark.timeout(300)
def test_seeded_sampling_with_speculation_is_reproducible(speculating, prompts) -> None:
    """float32, temperature 0.8 with a seed: the same outputs twice, max_tokens long."""
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    first = speculating.generate(prompts[-2:], params)
    second = speculating.generate(prompts[-2:], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 24 for o in first)


# Two CPU ranks, with ENGINE's chunks of 16, prefix caching and a pool that preempts.
TP2 = dict(ENGINE, nproc_per_node=2, device="cpu")
# Prompts that repeat themselves: where prompt lookup finds something to propose to a random
# model (whose answers to the chat prompts repeat nothing).
PATTERN = [5, 17, 42, 99, 7, 63]
PATTERN_PROMPTS = [PATTERN * 4, [3] + PATTERN * 6 + [8, 9]]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smollm2_gguf) -> tuple[str, str]:
    """A sharp tiny random Llama with smollm2's vocabulary (and tokenizer, so the parity prompts
    are its text too), and another of that vocabulary but other heads (other weights) to draft
    for it."""
    target = sharp_chat_llama(tmp_path_factory.mktemp("tiny-target"), smollm2_gguf)
    draft, _ = sharp_llama(tmp_path_factory.mktemp("tiny-draft"), heads=2, kv_heads=1,
                           vocab=SMOLLM2_VOCAB)
    return target, draft


@pytest.fixture(scope="module")
def sharp_models(tmp_path_factory) -> tuple[str, str]:
    """A sharp tiny Llama of 250 tokens, and another of that vocabulary but other heads (other
    weights) to draft for it."""
    target, _ = sharp_llama(tmp_path_factory.mktemp("sharp-target"), heads=4, kv_heads=2)
    draft, _ = sharp_llama(tmp_path_factory.mktemp("sharp-draft"), heads=2, kv_heads=1)
    return target, draft


@pytest.fixture(scope="module")
def tiny_expected(tiny_models, prompts) -> list[tuple[list[int], str | None]]:
    """The tiny target's greedy outputs of the ten prompts and the two repeating patterns,
    under TP=2 without speculation."""
    with LLM(tiny_models[0], **TP2) as llm:
        return tokens_and_reasons(llm, prompts + PATTERN_PROMPTS, GREEDY)


@pytest.mark.timeout(400)
def test_a_tiny_draft_over_two_ranks_equals_speculation_off(tiny_models, tiny_expected,
                                                           prompts) -> None:
    """float32 greedy over the ten prompts (and two repeating patterns) on a sharp tiny random
    Llama split over two CPU ranks, with chunks of 16, prefix caching and preemption: a tiny
    random draft model of the same vocabulary (whole on each rank) proposing gives the outputs
    of not speculating."""
    target, draft = tiny_models
    with LLM(target, **TP2, **dict(SPECULATIVE, speculative="draft", draft_model=draft)) as llm:
        assert tokens_and_reasons(llm, prompts + PATTERN_PROMPTS, GREEDY) == tiny_expected
        stats = wait_idle(llm.client)
    assert stats.spec_decode_num_drafts > 0 and stats.num_preemptions > 0, stats
    assert stats.prefix_cache_hits > 0 and stats.speculative == "draft", stats


@pytest.mark.timeout(400)
def test_prompt_lookup_over_two_ranks_equals_speculation_off(sharp_models) -> None:
    """float32 greedy on a sharp tiny Llama of 250 tokens (whose outputs repeat themselves,
    so prompt lookup proposes: the 49,152-token one's never do) split over two CPU ranks, with
    chunks of 16, prefix caching and preemption (FAMILY_ENGINE): the outputs of not
    speculating."""
    model = sharp_models[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = PATTERN_PROMPTS + [PATTERN[:4] * 5]
    options = dict(FAMILY_ENGINE, nproc_per_node=2, device="cpu")
    with LLM(model, **options) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(model, **options, **SPECULATIVE) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        stats = wait_idle(llm.client)
    assert stats.spec_decode_num_drafts > 0 and stats.num_preemptions > 0, stats


# smollm2's 9 query and 3 KV heads over two ranks, unequally: KV heads 0-1 with query heads 0-5,
# then KV head 2 with query heads 6-8 (runtime/layers/parallel.py). ENGINE's chunks of 16,
# prefix caching and its pool of 24 blocks that preempts.
SMOLLM2_TP2 = dict(ENGINE, nproc_per_node=2, device="cpu")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_smollm2_over_two_ranks_speculating_equals_one_rank_without(expected, prompts,
                                                                    method) -> None:
    """float32 greedy over the ten prompts with smollm2 split over two CPU ranks, chunks of 16,
    prefix caching and preemption, speculating by prompt lookup (requests without a match decode
    one token, as without speculation) or with smollm2 drafting for itself (whole on each
    rank): one rank's outputs without speculation, token for token."""
    # A draft verifies more requests at a time, so a pool of 12 blocks preempts (as at one rank).
    options = dict(SPECULATIVE, speculative=method) if method == "ngram" else dict(
        SPECULATIVE, speculative=method, draft_model="smollm2", num_kv_blocks=12)
    with LLM("smollm2", **{**SMOLLM2_TP2, **options}) as llm:
        got = tokens_and_reasons(llm, prompts, GREEDY)
        stats = wait_idle(llm.client)
    assert got == expected
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > 0, stats
    assert stats.prefix_cache_hits > 0 and stats.speculative == method, stats
    if method == "draft":
        assert stats.spec_decode_acceptance_rate > 0.9, stats


@pytest.fixture(scope="module")
def drafting():
    """smollm2 drafting for itself, in a pool of 12 blocks (a draft verifies more requests at
    a time than prompt lookup: this one preempts)."""
    with LLM("smollm2", **dict(ENGINE, num_kv_blocks=12), **dict(
            SPECULATIVE, speculative="draft", draft_model="smollm2")) as llm:
        yield llm


@pytest.mark.timeout(600)
def test_smollm2_drafting_for_itself_equals_speculation_off(drafting, expected, prompts) -> None:
    """float32 greedy over the ten prompts, --speculative draft with smollm2 as its own draft
    model, chunks of 16 and prefix caching (the chat prompts share their system prompt's
    block), in a pool of 12 blocks that preempts: the outputs of the engine without
    speculation, and nearly every proposal accepted."""
    assert tokens_and_reasons(drafting, prompts, GREEDY) == expected
    stats = wait_idle(drafting.client)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert stats.spec_decode_acceptance_rate > 0.9, stats


@pytest.mark.timeout(300)
def test_constrained_requests_verify_their_draft_models_proposals(plain, drafting,
                                                                  prompts) -> None:
    """float32 greedy under a grammar with a draft model: each request's draft model proposes
    after the step that samples its last token, the scheduler cuts the proposals at the first
    token the grammar refuses and masks each row of the rest, the next step verifies them;
    the outputs of the engine without speculation, and proposals accepted."""
    before = wait_idle(drafting.client)
    assert_constrained_outputs_equal(drafting, plain, prompts)
    after = wait_idle(drafting.client)
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens


def test_speculation_keeps_buckets_for_the_steps_it_leaves() -> None:
    """Configuration only: auto is compiled on CUDA with speculation too (the steps too large to
    speculate keep their graphs), and bucketed or compiled steps are not refused with it."""
    from spmd_runtime.protocol.buckets import execution_mode

    assert execution_mode(EngineConfig(speculative="ngram"), "cuda") == "compiled"
    assert execution_mode(EngineConfig(speculative="ngram"), "cpu") == "eager"
    assert EngineConfig(speculative="ngram", execution_mode="bucketed").speculative == "ngram"
    with pytest.raises(ValueError, match="--prompt-lookup-min 5 is above"):
        EngineConfig(prompt_lookup_min=5, prompt_lookup_max=4)
    with pytest.raises(ValueError, match="--speculative draft needs --draft-model"):
        EngineConfig(speculative="draft")


# Buckets of 1-8 requests (decodes) and 1-4 prompts of up to 64 tokens; a step speculates when
# at most two requests run.
BUCKETED = dict(execution_mode="bucketed", prompt_bs_bucket="1,4,4", prompt_seq_bucket="16,64,64",
                decode_bs_bucket="1,8,8", decode_seq_bucket="128,128,128", max_model_len=128,
                max_num_batched_tokens=64, dtype="float32")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_bucketed_steps_that_verify_proposals_equal_speculation_off(sharp_models,
                                                                    method) -> None:
    """float32 greedy on a sharp tiny Llama with buckets: six requests decode in padded
    bucketed steps (six rows in a bucket of eight) while more than two run, then the last two
    speculate, verifying proposals (prompt lookup, or a tiny random draft model, which also
    reads every bucketed step's tokens) in decode steps where each proposal is a row of the
    bucket, attending to its context up to itself; the outputs of the eager engine without
    speculation."""
    target, draft = sharp_models
    prompts = PATTERN_PROMPTS + [PATTERN[:4] * 5, [9, 8, 7], [11] * 5, [200, 3, 40, 17]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (40, 40, 6, 8, 10, 12)]
    with LLM(target, dtype="float32", max_model_len=128) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    options = dict(SPECULATIVE, speculative=method, speculative_disable_by_batch_size=2,
                   draft_model=draft if method == "draft" else "")
    with LLM(target, **BUCKETED, **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        stats = wait_idle(llm.client)
    assert stats.bucketing and stats.padding_waste > 0, stats
    assert stats.spec_decode_num_drafts > 0, stats


@pytest.mark.timeout(300)
def test_on_the_default_device_speculation_equals_speculation_off(tmp_path) -> None:
    """float32 greedy on a sharp tiny Llama, one worker on the default device (CUDA where there
    is one: the verification's device path), eager: speculating gives the outputs of not
    speculating, and proposals are accepted."""
    model, _ = sharp_llama(tmp_path / "sharp", heads=4, kv_heads=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(dtype="float32", execution_mode="eager", max_model_len=128)
    with LLM(model, **options) as llm:
        expected = [o.token_ids for o in llm.generate(PATTERN_PROMPTS, params)]
    with LLM(model, **options, **SPECULATIVE) as llm:
        assert [o.token_ids for o in llm.generate(PATTERN_PROMPTS, params)] == expected
        assert llm.client.stats().spec_decode_num_drafts > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_on_cuda_verify_steps_replay_decode_graphs(sharp_models, method) -> None:
    """float32 greedy on CUDA with graphs (compiled): the requests verifying proposals take
    rows of the decode buckets, whose captured graphs they replay; the outputs of the eager
    engine without speculation, and no step outside the buckets."""
    target, draft = sharp_models
    prompts = PATTERN_PROMPTS + [PATTERN[:4] * 5, [9, 8, 7], [11] * 5, [200, 3, 40, 17]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (40, 40, 6, 8, 10, 12)]
    with LLM(target, dtype="float32", max_model_len=128, device="cuda",
             execution_mode="eager") as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    options = dict(SPECULATIVE, speculative=method, speculative_disable_by_batch_size=2,
                   draft_model=draft if method == "draft" else "")
    with LLM(target, **{**BUCKETED, "execution_mode": "compiled"}, device="cuda",
             **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        stats = wait_idle(llm.client)
    assert stats.spec_decode_num_drafts > 0 and stats.batches_outside_buckets == 0, stats
    assert stats.runtime_graph_compilations == 0, stats
