"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head) over a paged KV cache."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.attention import AttentionBatch, paged_attention
from runtime.layers.linear import linear
from runtime.layers.norm import RMSNorm, rms_norm
from runtime.layers.rotary import RotaryEmbedding, apply_rotary
from runtime.model_config import ModelConfig


def _linear_weight(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class LlamaAttention(nn.Module):
    """The attention block's weights; its computation is in LayerPieces and paged_attention."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Q, K and V share one matmul: one large GEMM beats three small ones.
        self.qkv_proj = _linear_weight(self.q_size + 2 * self.kv_size, config.hidden_size, dtype)
        self.qkv_bias: nn.Parameter | None = None
        self.o_proj = _linear_weight(config.hidden_size, self.q_size, dtype)
        self.scale = self.head_dim ** -0.5


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _linear_weight(2 * config.intermediate_size, config.hidden_size, dtype)
        self.down_proj = _linear_weight(config.hidden_size, config.intermediate_size, dtype)


def attention_inputs(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused QKV projection and rotary embedding: q [T, heads, dim], k and v [T, kv, dim]."""
    qkv = linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                        dim=-1)
    q, k = apply_rotary(q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
                        cos, sin)
    return q, k, v.view(-1, num_kv_heads, head_dim)


def attention_output_and_mlp(x: torch.Tensor, attended: torch.Tensor, o_weight: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                             down_weight: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """Output projection and residual, then norm, SwiGLU MLP and residual."""
    x = x + linear(attended.reshape(x.shape[0], -1), o_weight)
    gate, up = linear(rms_norm(x, norm_weight, eps), gate_up_weight).split(intermediate_size, dim=-1)
    return x + linear(F.silu(gate) * up, down_weight)


@dataclass(frozen=True)
class LayerPieces:
    """A decoder layer's dense computation, before and after attention. Attention itself runs
    eagerly between them, so compiled or captured pieces depend on the token count alone."""

    attention_inputs: Callable = attention_inputs
    attention_output_and_mlp: Callable = attention_output_and_mlp


EAGER = LayerPieces()


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                pieces: LayerPieces) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        q, k, v = pieces.attention_inputs(
            x, self.input_layernorm.weight, self.input_layernorm.eps, attn.qkv_proj,
            attn.qkv_bias, *rope, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        attended = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, attn.scale)
        return pieces.attention_output_and_mlp(
            x, attended, attn.o_proj, self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps, mlp.gate_up_proj, mlp.down_proj,
            mlp.intermediate_size)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                batch: AttentionBatch, pieces: LayerPieces = EAGER) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened batch, after the final norm. `pieces`
        computes the layers' dense parts (eager, or compiled for the batch's shape)."""
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.tables(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, batch, pieces)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face Llama checkpoints, fusing QKV and gate/up."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name}")
            return weights[name]

        self.embed_tokens.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            self.lm_head.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj.copy_(torch.cat([take(prefix + f"self_attn.{p}_proj.weight")
                                           for p in "qkv"]))
            if prefix + "self_attn.q_proj.bias" in weights:
                attn.qkv_bias = nn.Parameter(torch.cat(
                    [take(prefix + f"self_attn.{p}_proj.bias") for p in "qkv"]).to(
                        attn.qkv_proj.dtype), requires_grad=False)
            attn.o_proj.copy_(take(prefix + "self_attn.o_proj.weight"))
            layer.mlp.gate_up_proj.copy_(torch.cat([take(prefix + "mlp.gate_proj.weight"),
                                                    take(prefix + "mlp.up_proj.weight")]))
            layer.mlp.down_proj.copy_(take(prefix + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(prefix + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(
                take(prefix + "post_attention_layernorm.weight"))
