"""Tensor parallelism end to end: greedy outputs with TP > 1 equal TP = 1 (which equals
transformers, see test_llm_correctness.py), with sharded heads, replicated KV heads, a sharded
vocabulary and chunked row-parallel reductions."""
from __future__ import annotations

import pytest
from sharp_llama import GREEDY, SMALL, prompts, sharp_llama
from spmd_runtime.runtime import LLM, SamplingParams


def generate(model: str, **options) -> list[list[int]]:
    with LLM(model, **options) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 2, 4)],
                         ids=["tp2-sharded-kv", "tp4-replicated-kv"])
def test_tensor_parallel_equals_a_single_worker(tmp_path, heads, kv_heads, tp) -> None:
    model, _ = sharp_llama(tmp_path, heads, kv_heads)
    assert generate(model, nproc_per_node=tp, **SMALL) == generate(model, **SMALL)


@pytest.mark.timeout(600)
def test_chunked_row_parallel_reductions_give_the_same_outputs(tmp_path) -> None:
    model, _ = sharp_llama(tmp_path, 4, 2)
    chunked = generate(model, nproc_per_node=2, row_parallel_chunks=4,
                       row_parallel_chunk_threshold=1, **SMALL)
    assert chunked == generate(model, nproc_per_node=2, **SMALL)


@pytest.mark.timeout(600)
def test_overlapped_steps_with_two_ranks_give_the_same_outputs(tmp_path) -> None:
    """--overlap-steps on (as auto is on CUDA): each rank launches the next step before it
    finishes the one running; every rank must still run the same collectives in order."""
    model, _ = sharp_llama(tmp_path, 4, 2)
    with LLM(model, nproc_per_node=2, overlap_steps="on", **SMALL) as llm:
        overlapped = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        assert llm.client.stats().num_overlapped_steps > 0
    assert overlapped == generate(model, **SMALL)


@pytest.mark.timeout(600)
def test_smollm2_with_three_workers_equals_one() -> None:
    """9 query heads and 3 KV heads: one KV head and three query heads per rank."""
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
             "The three primary colors are"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    options = dict(num_kv_blocks=128, max_model_len=256)
    outputs = {}
    for tp in (1, 3):
        with LLM("smollm2", nproc_per_node=tp, **options) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(texts, params)]
    assert outputs[3] == outputs[1]
