"""Qwen2 and Qwen2.5: the Llama decoder with biases on the query, key and value projections
(merged into the QKV bias, its rows sharded with the QKV rows under tensor parallelism)."""
from __future__ import annotations

from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.models.layer_pieces import LAYER_PASSES, LAYER_STACK
from spmd_runtime.runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    # Llama's layers, projections in its layout: both fused CPU paths compute them.
    fused_cpu_paths = frozenset({LAYER_PASSES, LAYER_STACK})

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, tuple[int, ...]]]:
        required, optional = LlamaForCausalLM.checkpoint_shapes(config)
        qkv_biases = {name: shape for name, shape in optional.items()
                      if not name.endswith("o_proj.bias")}
        return {**required, **qkv_biases}, optional
