"""Gemma 3 (text-only, model_type gemma3_text): Gemma 2's layers with a per-head (1 + weight)
RMSNorm of queries and keys before the rotary embedding, and two rotary tables: the sliding-window
layers' (rope_local_base_freq, unscaled) and the others' (rope_theta and rope_scaling). Soft-caps
are off in the released models (plain attention paths then); the sliding window (five layers in
six) caps the context at its length, as Gemma 2's."""
from __future__ import annotations

import torch
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.layers.parallel import TensorParallel
from spmd_runtime.runtime.layers.rotary import RotaryEmbedding
from spmd_runtime.runtime.models.gemma2 import Gemma2ForCausalLM
from spmd_runtime.runtime.models.qwen3 import qk_norm_shapes


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    fused_cpu_paths: frozenset[str] = frozenset()       # Gemma 2's layers: none
    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 tp: TensorParallel | None = None) -> None:
        super().__init__(config, dtype, tp)
        self.sliding_rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings,
            config.sliding_rope_theta or config.rope_theta, None, dtype)

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, tuple[int, ...]]]:
        required, optional = Gemma2ForCausalLM.checkpoint_shapes(config)
        return {**required, **qk_norm_shapes(config)}, optional

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        full, sliding = self.rotary.tables(positions), self.sliding_rotary.tables(positions)
        return [sliding if i in self.config.sliding_layers else full
                for i in range(len(self.layers))]
