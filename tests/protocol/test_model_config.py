"""ModelConfig from a Mistral config.json (protocol/model_config.py): the Llama decoder whose
sliding window, where set, is on every layer and leaves the full context, and whose head_dim
need not be hidden / heads; the windows of the other families' config.json layouts."""
from __future__ import annotations

import dataclasses

import pytest
from spmd_runtime.protocol.model_config import ModelConfig

MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 256,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
           "max_position_embeddings": 32768, "rope_theta": 1e6}


def test_mistral_window_is_on_every_layer_and_keeps_the_context() -> None:
    config = ModelConfig.from_hf_dict({**MISTRAL, "sliding_window": 4096})
    assert (config.architecture, config.head_dim, config.max_position_embeddings) == (
        "mistral", 24, 32768)
    assert (config.sliding_window, config.sliding_layers, config.all_layers_slide) == (
        4096, (0, 1), True)
    assert [config.window_of(i) for i in range(2)] == [4096, 4096]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_qwen2_use_sliding_window_slides_the_layers_from_max_window_layers() -> None:
    qwen2 = {**MISTRAL, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
             "num_hidden_layers": 4, "sliding_window": 64, "max_window_layers": 1}
    config = ModelConfig.from_hf_dict({**qwen2, "use_sliding_window": True})
    assert (config.sliding_window, config.sliding_layers, config.all_layers_slide) == (
        64, (1, 2, 3), False)
    assert config.window_of(0) is None and config.window_of(3) == 64
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    # The released Qwen2 configs: a window written, but switched off.
    off = ModelConfig.from_hf_dict({**qwen2, "use_sliding_window": False})
    assert (off.sliding_window, off.sliding_layers) == (None, ())


def test_sliding_layers_without_a_window_are_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window is not set"):
        ModelConfig.from_hf_dict({**MISTRAL, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ValueError, match="need a sliding_window"):
        dataclasses.replace(ModelConfig.from_hf_dict(MISTRAL), sliding_layers=(0,))


def test_mistral_without_a_window_keeps_its_context() -> None:
    # Mistral 7B v0.2 and later set sliding_window to null; head_dim may be null too.
    config = ModelConfig.from_hf_dict({**MISTRAL, "sliding_window": None, "head_dim": None})
    assert (config.head_dim, config.max_position_embeddings) == (16, 32768)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
