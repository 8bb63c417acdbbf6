"""Bucketed engines end to end: greedy outputs are identical with --execution-mode eager,
bucketed and compiled, warmup leaves nothing to compile while serving, and a batch larger than every
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
TWO_BUCKETS = dict(execution_mode="bucketed", prompt_bs_bucket="1,1,1", prompt_seq_bucket="64,64,64",
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
    with LLM(model, **{"dtype": "float32", **options}) as llm:
        outputs = llm.generate(prompts(), GREEDY)
        stats = llm.client.stats()
    return [o.token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def unbucketed_run(sharp_model):
    """(outputs, stats) of the eager engine, no buckets: the reference of every bucketed run
    (a deterministic greedy run, so computed once for the module)."""
    directory, _ = sharp_model
    return run(directory, execution_mode="eager", max_num_batched_tokens=64, max_num_seqs=4,
               max_model_len=64, num_kv_blocks=64)


@pytest.mark.timeout(600)
def test_greedy_outputs_are_identical_with_bucketing_off_on_and_compiled(
        sharp_model, unbucketed_run, greedy_reference) -> None:
    directory, model = sharp_model
    unbucketed, stats = unbucketed_run
    assert not stats.bucketing and stats.padding_waste == 0.0
    refs = [greedy_reference.generate(model, p, GREEDY.max_tokens) for p in prompts()]
    greedy_reference.check(model, prompts(), unbucketed, refs, min_exact=8)

    eager, stats = run(directory, **TWO_BUCKETS)
    assert eager == unbucketed
    assert stats.bucketing and stats.batches_outside_buckets == 0
    assert stats.padding_waste > 0, "one-at-a-time prompts padded to 64 tokens"
    assert stats.runtime_graph_compilations == 0

    compiled, stats = run(directory, **dict(TWO_BUCKETS, execution_mode="compiled"))
    assert compiled == unbucketed
    assert stats.runtime_graph_compilations == 0, "warmup should have compiled every shape"


@pytest.mark.timeout(600)
def test_without_warmup_the_first_batches_compile_while_serving(sharp_model,
                                                               unbucketed_run) -> None:
    directory, _ = sharp_model
    # On CPU, where compiled means torch.compile per token count (on CUDA it means graphs,
    # which without warmup are not captured at all: nothing compiles there).
    outputs, stats = run(directory, skip_warmup=True, device="cpu",
                         **dict(TWO_BUCKETS, execution_mode="compiled"))
    assert stats.runtime_graph_compilations == 2          # the prompt shape and the decode shape
    reference, _ = unbucketed_run
    assert outputs == reference


@pytest.mark.timeout(600)
def test_default_buckets_give_the_unbucketed_outputs(sharp_model, unbucketed_run) -> None:
    """The default buckets: with the C++ attention (it reads context lengths) decode buckets
    have one context length, the longest, so each decode group's block table is that wide."""
    directory, _ = sharp_model
    reference, _ = unbucketed_run
    outputs, stats = run(directory, execution_mode="bucketed", device="cpu",
                         max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                         num_kv_blocks=64)
    assert stats.bucketing and stats.batches_outside_buckets == 0
    assert outputs == reference


@pytest.mark.timeout(600)
def test_batches_above_the_largest_bucket_run_unpadded_and_are_counted(sharp_model) -> None:
    directory, _ = sharp_model
    options = dict(TWO_BUCKETS, max_model_len=128)      # contexts now outgrow the 64 bucket
    options["execution_mode"] = "compiled"
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(directory, **{"dtype": "float32", **options}) as llm:
        bucketed = [o.token_ids for o in llm.generate(prompts(4)[2:], params)]
        stats = llm.client.stats()
    assert stats.batches_outside_buckets > 0
    assert stats.runtime_graph_compilations == 0, "unpadded batches run eagerly"
    with LLM(directory, execution_mode="eager", dtype="float32", **{
            k: v for k, v in options.items() if "bucket" not in k and k != "execution_mode"}) as llm:
        assert bucketed == [o.token_ids for o in llm.generate(prompts(4)[2:], params)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.timeout(600)
def test_greedy_outputs_are_identical_with_cuda_graphs_and_the_kernel_on_and_off(
        sharp_model) -> None:
    directory, _ = sharp_model
    options = dict(TWO_BUCKETS, decode_bs_bucket="1,2,4", device="cuda", dtype="float32")
    eager, _ = run(directory, attention_backend="torch", **options)         # buckets, no graphs
    options["execution_mode"] = "compiled"
    graphed, stats = run(directory, attention_backend="torch", **options)
    assert graphed == eager
    assert stats.runtime_graph_compilations == 0
    if importlib.util.find_spec("triton") is not None:
        kernel, _ = run(directory, attention_backend="triton", **options)
        assert kernel == eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.timeout(600)
def test_default_gpu_buckets_pack_prompts_and_graph_decodes_by_batch_size(sharp_model) -> None:
    """A GPU engine's own buckets: prompt steps packed and unpadded, decode graphs by batch
    size over one context length, read from tensors by the kernel: the eager outputs."""
    directory, _ = sharp_model
    common = dict(device="cuda", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4,
                  max_model_len=64, num_kv_blocks=64)
    eager, _ = run(directory, execution_mode="eager", **common)
    graphed, stats = run(directory, execution_mode="compiled", **common)
    assert graphed == eager
    assert stats.runtime_graph_compilations == 0 and stats.batches_outside_buckets == 0
