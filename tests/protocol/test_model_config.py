"""ModelConfig from a Mistral config.json (protocol/model_config.py): the Llama decoder whose
sliding window, where set, caps the context, and whose head_dim need not be hidden / heads."""
from __future__ import annotations

from spmd_runtime.protocol.model_config import ModelConfig

MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 256,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
           "max_position_embeddings": 32768, "rope_theta": 1e6}


def test_mistral_window_caps_the_context() -> None:
    config = ModelConfig.from_hf_dict({**MISTRAL, "sliding_window": 4096})
    assert (config.architecture, config.head_dim, config.max_position_embeddings) == (
        "mistral", 24, 4096)


def test_mistral_without_a_window_keeps_its_context() -> None:
    # Mistral 7B v0.2 and later set sliding_window to null; head_dim may be null too.
    config = ModelConfig.from_hf_dict({**MISTRAL, "sliding_window": None, "head_dim": None})
    assert (config.head_dim, config.max_position_embeddings) == (16, 32768)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
