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
    ranks_on_one_host,
    save_sharp,
    transformers_greedy,
)
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime import LLM
from spmd_runtime.runtime.loaders.hf_dir import load_hf_weights, read_hf_config
from spmd_runtime.runtime.models import build_model

SHAPE, ENGINE = FAMILY_SHAPE, FAMILY_ENGINE
# The sliding window of the families that have one (test_sliding_window tests windows
# closely): shorter than the longer family prompts, so that HF and GGUF checkpoints slide.
WINDOW = 32


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
        # A sliding window on every layer, shorter than the longer sequences here.
        return transformers.Phi3ForCausalLM, transformers.Phi3Config(
            **SHAPE, sliding_window=WINDOW, pad_token_id=0)
    if family == "mistral":
        # A Llama with a sliding window (on every layer, as Phi-3's; longer than the sequences
        # here: llama.cpp's GGUF drops it, test_gguf reads these checkpoints too) and a head_dim
        # that is not hidden_size / heads.
        return transformers.MistralForCausalLM, transformers.MistralConfig(
            **SHAPE, head_dim=24, sliding_window=100)
    if family == "gemma2":
        # head_dim * heads != hidden_size, a query scale other than head_dim's, soft-caps low
        # enough to change the logits, and a window on every other layer.
        # Eager attention named: transformers versions whose default is SDPA drop the soft-cap
        # (on a GPU host's transformers the reference differed by 2.5 in the logits).
        return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
            **SHAPE, head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=10.0,
            final_logit_softcapping=15.0, sliding_window=WINDOW, attn_implementation="eager")
    if family == "gemma3":
        # Sliding layers with a rope base of their own, the others with linear rope scaling;
        # no soft-caps (the released models' setting).
        return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
            **SHAPE, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"], rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    raise ValueError(family)


FAMILIES = ["qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3"]
# Gemma's norms scale by 1 + weight: weights near 0 keep them near one, as other families'.
NORM_CENTER = {"gemma2": 0.0, "gemma3": 0.0}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) of one family's sharp tiny checkpoint."""
    model_class, config = hf_checkpoint(request.param)
    return save_sharp(tmp_path_factory.mktemp(request.param), lambda: model_class(config),
                      NORM_CENTER.get(request.param, 1.0))


def test_gemma2_config_of_the_released_models() -> None:
    """google/gemma-2-2b's config.json (transformers 4 layout: no layer_types, both activation
    keys): its caps and query scale are read, and its window slides its even layers, leaving
    the full context."""
    config = ModelConfig.from_hf_dict({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "bos_token_id": 2,
        "eos_token_id": [1, 107], "cache_implementation": "hybrid", "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "sliding_window": 4096, "vocab_size": 256000})
    assert (config.max_position_embeddings, config.attn_logit_softcapping,
            config.final_logit_softcapping, config.query_pre_attn_scalar) == (8192, 50.0, 30.0, 256)
    assert (config.sliding_window, config.sliding_layers) == (4096, tuple(range(0, 26, 2)))
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_gemma3_config_of_the_released_models() -> None:
    """google/gemma-3-1b-it's config.json (transformers 4 layout: rope_local_base_freq and
    sliding_window_pattern, no layer_types): five layers in six slide, with their own rope
    base and a window of 512, leaving the full context."""
    config = ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "bos_token_id": 2,
        "eos_token_id": [1, 106], "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "vocab_size": 262144})
    assert (config.max_position_embeddings, config.rope_theta, config.sliding_rope_theta,
            config.sliding_window) == (32768, 1e6, 1e4, 512)
    assert config.sliding_layers == tuple(i for i in range(26) if i not in (5, 11, 17, 23))
    assert config.to_hf_dict()["architectures"] == ["Gemma3ForCausalLM"]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_logits_equal_transformers(checkpoint) -> None:
    directory, hf = checkpoint
    config = read_hf_config(directory)
    assert config.max_position_embeddings == 256
    assert config.sliding_window == getattr(hf.config, "sliding_window", None)
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
    with LLM(directory, **ranks_on_one_host(tp), **ENGINE) as llm:
        outputs = llm.generate(family_prompts(), GREEDY)
        stats = llm.client.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert [o.token_ids for o in outputs] == [transformers_greedy(hf, p) for p in family_prompts()]


def test_greedy_logits_keep_the_models_dtype_unless_capped(checkpoint) -> None:
    """bfloat16 (assertions on bf16 logits and their float32 widening): compute_logits(...,
    float32=False), which a step of greedy rows asks for, is the bf16 logits themselves, whose
    widening is exactly the float32 logits; Gemma 2's soft-capped ones stay float32."""
    directory, _ = checkpoint
    config = read_hf_config(directory)
    model = build_model(config, torch.bfloat16)
    model.load_hf_state_dict(load_hf_weights(directory, config, torch.bfloat16))
    hidden = torch.randn(5, config.hidden_size).bfloat16()
    with torch.inference_mode():
        wide, kept = model.compute_logits(hidden), model.compute_logits(hidden, float32=False)
    capped = config.final_logit_softcapping is not None
    assert wide.dtype == torch.float32 and kept.dtype == (torch.float32 if capped else torch.bfloat16)
    assert kept.shape == (5, config.vocab_size) and torch.equal(kept.float(), wide)
