"""The model families beside Llama (runtime/models/): tiny random checkpoints saved by
transformers' own classes give transformers' logits in process, and its greedy tokens through
the engine at one and two ranks, under prefix caching, chunked prefill and preemption."""
from __future__ import annotations

import pytest
import torch
from sharp_llama import (
    FAMILY_ENGINE,
    FAMILY_SHAPE,
    GREEDY,
    family_prompts,
    save_sharp,
    transformers_greedy,
)
from spmd_runtime.runtime import LLM
from spmd_runtime.runtime.loaders.hf_dir import load_hf_weights, read_hf_config
from spmd_runtime.runtime.models import build_model

SHAPE, ENGINE = FAMILY_SHAPE, FAMILY_ENGINE


def hf_checkpoint(family: str):
    """(transformers model class, its config) of a tiny `family` model."""
    import transformers

    if family == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **SHAPE, tie_word_embeddings=True)
    if family == "qwen3":
        # attention_bias (off in the released models) adds q, k, v and o biases to the norms.
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            **SHAPE, head_dim=16, attention_bias=True)
    if family == "phi3":
        # A sliding window on every layer, longer than any sequence here: it caps the context.
        return transformers.Phi3ForCausalLM, transformers.Phi3Config(
            **SHAPE, sliding_window=100, pad_token_id=0)
    if family == "mistral":
        # A Llama with a sliding window (capping the context, as Phi-3's) and a head_dim that is
        # not hidden_size / heads.
        return transformers.MistralForCausalLM, transformers.MistralConfig(
            **SHAPE, head_dim=24, sliding_window=100)
    raise ValueError(family)


FAMILIES = ["qwen2", "qwen3", "phi3", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) of one family's sharp tiny checkpoint."""
    model_class, config = hf_checkpoint(request.param)
    return save_sharp(tmp_path_factory.mktemp(request.param), lambda: model_class(config))


def test_logits_equal_transformers(checkpoint) -> None:
    directory, hf = checkpoint
    config = read_hf_config(directory)
    assert config.max_position_embeddings == (hf.config.sliding_window or 256)
    model = build_model(config, torch.float32)
    model.load_hf_state_dict(load_hf_weights(directory, config, torch.float32))
    ids = family_prompts()[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    diff = float((model.eval().prompt_logits(ids) - expected).abs().max())
    print(f"{config.architecture}: max |logit difference| {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_greedy_equals_transformers(checkpoint, tp) -> None:
    directory, hf = checkpoint
    with LLM(directory, nproc_per_node=tp, **ENGINE) as llm:
        outputs = llm.generate(family_prompts(), GREEDY)
        stats = llm.client.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert [o.token_ids for o in outputs] == [transformers_greedy(hf, p) for p in family_prompts()]
