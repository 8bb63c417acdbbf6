"""Qwen3: the Llama decoder with a per-head RMSNorm of queries and keys (q_norm, k_norm, weights
of head_dim) between the projection and the rotary embedding, and attention biases (q, k, v and
o) where the config's attention_bias asks for them."""
from __future__ import annotations

from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.models.layer_pieces import LAYER_PASSES, LAYER_STACK
from spmd_runtime.runtime.models.llama import LlamaForCausalLM


def qk_norm_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The per-head query and key RMSNorm weights of every layer (Qwen3, Gemma 3)."""
    return {f"model.layers.{i}.self_attn.{name}.weight": (config.head_dim,)
            for i in range(config.num_hidden_layers) for name in ("q_norm", "k_norm")}


class Qwen3ForCausalLM(LlamaForCausalLM):
    # Llama's layers, projections in its layout: both fused CPU paths compute them.
    fused_cpu_paths = frozenset({LAYER_PASSES, LAYER_STACK})

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, tuple[int, ...]]]:
        required, optional = LlamaForCausalLM.checkpoint_shapes(config)
        return {**required, **qk_norm_shapes(config)}, optional
