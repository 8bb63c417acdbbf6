"""Tensor parallelism end to end: greedy outputs with TP > 1 equal TP = 1 (which equals
transformers, see test_llm_correctness.py), with sharded heads, replicated KV heads, heads split
unequally (smollm2 over two ranks), a sharded vocabulary and chunked row-parallel reductions."""
from __future__ import annotations

import pytest
from sharp_llama import GREEDY, SMALL, prompts, sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams


def generate(model: str, **options) -> list[list[int]]:
    # On CPU, as the TP tests compare ranks on one host (a one-GPU host has no device per rank).
    with LLM(model, **{"dtype": "float32", "device": "cpu", **options}) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """sharp_model(heads, kv_heads): the directory of that sharp Llama, made once per module."""
    made: dict[tuple[int, int], str] = {}

    def get(heads: int, kv_heads: int) -> str:
        if (heads, kv_heads) not in made:
            directory = tmp_path_factory.mktemp(f"sharp-llama-{heads}-{kv_heads}")
            made[heads, kv_heads] = sharp_llama(directory, heads, kv_heads)[0]
        return made[heads, kv_heads]
    return get


@pytest.fixture(scope="module")
def outputs_of():
    """outputs_of(model, **options): generate(model, **options), run once per module for each
    model and options (greedy runs are deterministic: the references are shared, e.g. the single
    worker's outputs that several TP runs are compared with)."""
    done: dict = {}

    def get(model: str, **options) -> list[list[int]]:
        key = (model, tuple(sorted(options.items())))
        if key not in done:
            done[key] = generate(model, **options)
        return done[key]
    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 2, 4)],
                         ids=["tp2-sharded-kv", "tp4-replicated-kv"])
def test_tensor_parallel_equals_a_single_worker(sharp_model, outputs_of, heads, kv_heads,
                                                tp) -> None:
    model = sharp_model(heads, kv_heads)
    assert outputs_of(model, nproc_per_node=tp, **SMALL) == outputs_of(model, **SMALL)


@pytest.mark.timeout(600)
def test_chunked_row_parallel_reductions_give_the_same_outputs(sharp_model, outputs_of) -> None:
    model = sharp_model(4, 2)
    chunked = generate(model, nproc_per_node=2, row_parallel_chunks=4,
                       row_parallel_chunk_threshold=1, **SMALL)
    assert chunked == outputs_of(model, nproc_per_node=2, **SMALL)


@pytest.mark.timeout(600)
def test_overlapped_steps_with_two_ranks_give_the_same_outputs(sharp_model, outputs_of) -> None:
    """--step-pipelining overlap (as auto is on CUDA): each rank launches the next step before it
    finishes the one running; every rank must still run the same collectives in order."""
    model = sharp_model(4, 2)
    with LLM(model, nproc_per_node=2, step_pipelining="overlap", dtype="float32", device="cpu",
             **SMALL) as llm:
        overlapped = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        assert llm.client.stats().num_overlapped_steps > 0
    assert overlapped == outputs_of(model, **SMALL)


# smollm2 dequantised in float32 over two ranks, speculating or not: tests/runtime/
# test_speculative_decoding.py (test_smollm2_over_two_ranks_speculating_equals_one_rank_without).


@pytest.mark.timeout(600)
def test_smollm2_kept_in_its_gguf_blocks_with_two_unequal_workers_equals_one() -> None:
    """--quantization gguf, float32, smollm2's 9 query and 3 KV heads over two ranks: rank 0
    holds KV heads 0-1 and query heads 0-5, rank 1 the rest (runtime/layers/parallel.py). Each
    rank holds its rows (column-parallel) or its blocks of columns (row-parallel: 384 or 192 of
    576, 768 of 1,536, whole blocks of 32) of the file's Q4_1 and Q8_0 blocks; the partial
    products' sum gives one worker's tokens."""
    texts = ["The capital of France is"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = {}
    for tp in (1, 2):
        with LLM("smollm2", nproc_per_node=tp, dtype="float32", device="cpu", quantization="gguf",
                 num_kv_blocks=16, max_model_len=64) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(texts, params)]
    assert outputs[2] == outputs[1]
