"""Bucketed engines end to end: greedy outputs are identical with bucketing off, on (eager) and
on with --compile, warmup leaves nothing to compile while serving, and a batch larger than every
bucket runs unpadded and is counted."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from sharp_llama import sharp_llama as make_sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams

VOCAB = 256
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Two buckets: prompts one at a time up to 64 tokens, decodes four at a time up to 64 tokens.
TWO_BUCKETS = dict(bucketing="on", prompt_bs_bucket="1,1,1", prompt_seq_bucket="64,64,64",
                   decode_bs_bucket="4,4,4", decode_seq_bucket="64,64,64",
                   max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                   num_kv_blocks=64)


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    return make_sharp_llama(tmp_path_factory.mktemp("sharp-llama"), vocab=VOCAB)


def prompts(count: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist()
            for n in (1, 5, 17, 33, 40, 51, 9, 24)[:count]]


def run(model: str, **options):
    with LLM(model, **options) as llm:
        outputs = llm.generate(prompts(), GREEDY)
        stats = llm.client.stats()
    return [o.token_ids for o in outputs], stats


@pytest.mark.timeout(600)
def test_greedy_outputs_are_identical_with_bucketing_off_on_and_compiled(
        sharp_model, greedy_reference) -> None:
    directory, model = sharp_model
    unbucketed, stats = run(directory, bucketing="off", max_num_batched_tokens=64,
                            max_num_seqs=4, max_model_len=64, num_kv_blocks=64)
    assert not stats.bucketing and stats.padding_waste == 0.0
    refs = [greedy_reference.generate(model, p, GREEDY.max_tokens) for p in prompts()]
    greedy_reference.check(model, prompts(), unbucketed, refs, min_exact=8)

    eager, stats = run(directory, **TWO_BUCKETS)
    assert eager == unbucketed
    assert stats.bucketing and stats.batches_outside_buckets == 0
    assert stats.padding_waste > 0, "one-at-a-time prompts padded to 64 tokens"
    assert stats.runtime_graph_compilations == 0

    compiled, stats = run(directory, compile=True, **TWO_BUCKETS)
    assert compiled == unbucketed
    assert stats.runtime_graph_compilations == 0, "warmup should have compiled every shape"


@pytest.mark.timeout(600)
def test_without_warmup_the_first_batches_compile_while_serving(sharp_model) -> None:
    directory, _ = sharp_model
    outputs, stats = run(directory, compile=True, skip_warmup=True, **TWO_BUCKETS)
    assert stats.runtime_graph_compilations == 2          # the prompt shape and the decode shape
    reference, _ = run(directory, bucketing="off", max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=64, num_kv_blocks=64)
    assert outputs == reference


@pytest.mark.timeout(600)
def test_batches_above_the_largest_bucket_run_unpadded_and_are_counted(sharp_model) -> None:
    directory, _ = sharp_model
    options = dict(TWO_BUCKETS, max_model_len=128)      # contexts now outgrow the 64 bucket
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(directory, compile=True, **options) as llm:
        bucketed = [o.token_ids for o in llm.generate(prompts(4)[2:], params)]
        stats = llm.client.stats()
    assert stats.batches_outside_buckets > 0
    assert stats.runtime_graph_compilations == 0, "unpadded batches run eagerly"
    with LLM(directory, bucketing="off", **{k: v for k, v in options.items()
                                            if "bucket" not in k}) as llm:
        assert bucketed == [o.token_ids for o in llm.generate(prompts(4)[2:], params)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.timeout(600)
def test_greedy_outputs_are_identical_with_cuda_graphs_and_the_kernel_on_and_off(
        sharp_model) -> None:
    directory, _ = sharp_model
    options = dict(TWO_BUCKETS, decode_bs_bucket="1,2,4", device="cuda", dtype="float32")
    eager, _ = run(directory, enforce_eager=True, attention_backend="torch", **options)
    graphed, stats = run(directory, attention_backend="torch", **options)
    assert graphed == eager
    assert stats.runtime_graph_compilations == 0
    if importlib.util.find_spec("triton") is not None:
        kernel, _ = run(directory, attention_backend="triton", **options)
        assert kernel == eager
