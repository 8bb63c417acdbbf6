"""Qwen3: the Llama decoder with a per-head RMSNorm of queries and keys (q_norm, k_norm, weights
of head_dim) between the projection and the rotary embedding, and attention biases (q, k, v and
o) where the config's attention_bias asks for them."""
from __future__ import annotations

from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, tuple[int, ...]]]:
        required, optional = LlamaForCausalLM.checkpoint_shapes(config)
        norms = {f"model.layers.{i}.self_attn.{name}.weight": (config.head_dim,)
                 for i in range(config.num_hidden_layers) for name in ("q_norm", "k_norm")}
        return {**required, **norms}, optional
