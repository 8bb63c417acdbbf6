"""Phi-3: the Llama decoder from a checkpoint that stacks Q, K and V in one `qkv_proj` and gate
and up in one `gate_up_proj`. The loader splits them into their parts before taking a rank's
rows of each (read_stacked_parts). Its longrope scaling (the 128k models) is refused with the
other unimplemented rope types; its sliding window (on every layer) caps the context, up to
which it changes nothing (ModelConfig.from_hf_dict)."""
from __future__ import annotations

from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.models.layer_pieces import LAYER_PASSES, LAYER_STACK
from spmd_runtime.runtime.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # Llama's layers, projections in its layout: both fused CPU paths compute them.
    fused_cpu_paths = frozenset({LAYER_PASSES, LAYER_STACK})

    @staticmethod
    def stacked_tensors(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        stacked = {}
        for i in range(config.num_hidden_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            stacked[attn + "qkv_proj.weight"] = [(attn + f"{p}_proj.weight", rows)
                                                 for p, rows in zip("qkv", (q, kv, kv), strict=True)]
            stacked[mlp + "gate_up_proj.weight"] = [(mlp + f"{p}_proj.weight", config.intermediate_size)
                                                    for p in ("gate", "up")]
        return stacked

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, tuple[int, ...]]]:
        required, _ = LlamaForCausalLM.checkpoint_shapes(config)
        for name, parts in Phi3ForCausalLM.stacked_tensors(config).items():
            for part, _ in parts:
                del required[part]
            required[name] = (sum(rows for _, rows in parts), config.hidden_size)
        return required, {}
