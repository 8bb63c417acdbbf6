"""Gemma 2: the Llama decoder with embeddings scaled by sqrt(hidden_size), RMSNorms that scale by
(1 + weight), a norm after attention and one around the MLP (four per layer), a GeGLU MLP
(tanh-approximated GELU), attention scaled by query_pre_attn_scalar ** -0.5 with its scores
soft-capped (plain-torch attention, runtime/layers/capped_attention.py) and soft-capped final
logits. Its sliding window (every other layer) caps the context at the window's length, within
which every layer is exact full attention (ModelConfig.from_hf_dict)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.layers.attention import AttentionBatch
from spmd_runtime.runtime.layers.norm import RMSNorm, rms_norm
from spmd_runtime.runtime.layers.parallel import ShardLayout, TensorParallel, row_parallel_linear
from spmd_runtime.runtime.models.layer_pieces import LayerPieces, attention_inputs, gate_and_up
from spmd_runtime.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# The four norms of a layer, in checkpoint names (the module attributes carry the same names).
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


def gelu_mlp_inputs(x: torch.Tensor, attention_output: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, gate_up_weight: torch.Tensor,
                    intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual, norm, gate/up projection and GeGLU (tanh GELU): (new residual, input of the
    down projection)."""
    x, gate, up = gate_and_up(x, attention_output, norm_weight, eps, gate_up_weight,
                              intermediate_size)
    return x, F.gelu(gate, approximate="tanh") * up


GEGLU = LayerPieces(attention_inputs, gelu_mlp_inputs)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with the attention output normed before the residual, the MLP input normed
    by pre_feedforward_layernorm, and the MLP output normed before its residual."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shards: ShardLayout,
                 tp: TensorParallel) -> None:
        super().__init__(config, dtype, shards, tp)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        attn = self.self_attn
        attn.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        attn.softcap = config.attn_logit_softcapping

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                pieces: LayerPieces, keep: torch.Tensor | None = None) -> torch.Tensor:
        mlp, eps = self.mlp, self.pre_feedforward_layernorm.eps
        attention_output = rms_norm(self.attend(x, rope, kv_cache, batch, pieces, keep),
                                    self.post_attention_layernorm.weight, eps)
        x = x if keep is None else x[keep]
        x, activation = pieces.mlp_inputs(x, attention_output,
                                          self.pre_feedforward_layernorm.weight, eps,
                                          mlp.gate_up_proj, mlp.intermediate_size)
        mlp_output = row_parallel_linear(activation, mlp.down_proj, None, self.tp)
        return x + rms_norm(mlp_output, self.post_feedforward_layernorm.weight, eps)


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma2DecoderLayer
    pieces = GEGLU
    # No fused CPU path: they compute Llama's layers (SwiGLU, no extra norms, no soft cap).
    fused_cpu_paths: frozenset[str] = frozenset()

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 tp: TensorParallel | None = None) -> None:
        super().__init__(config, dtype, tp)
        # In the model's dtype, as transformers rounds it.
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item()

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, tuple[int, ...]]]:
        required, optional = LlamaForCausalLM.checkpoint_shapes(config)
        norms = {f"model.layers.{i}.{name}.weight": (config.hidden_size,)
                 for i in range(config.num_hidden_layers) for name in LAYER_NORMS[2:]}
        return {**required, **norms}, optional

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Llama's logits, soft-capped (cap * tanh(logits / cap)) before any sampling, in float32
        whenever they are capped (the cap in bf16 could tie what float32 tells apart)."""
        cap = self.config.final_logit_softcapping
        logits = super().compute_logits(hidden, float32 or cap is not None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Llama's, uncapped only: the cap's float32 tanh can tie logits apart, and the first
        index of a tie is what greedy decoding takes."""
        return super().greedy_tokens(hidden) if self.config.final_logit_softcapping is None \
            else None

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Llama's loading, the two MLP norms besides; every norm then holds 1 + its checkpoint
        weight (summed in float32 at least), so the shared RMSNorm code computes Gemma's norms."""
        super().load_hf_state_dict(weights)
        norms = [self.norm]
        for i, layer in enumerate(self.layers):
            for name in LAYER_NORMS[2:]:
                getattr(layer, name).weight.copy_(weights[f"model.layers.{i}.{name}.weight"])
            norms += [getattr(layer, name) for name in LAYER_NORMS]
            if layer.self_attn.q_norm is not None:      # Gemma 3
                norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        for norm in norms:
            weight = norm.weight
            norm.weight.copy_(weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1.0)
