"""A decoder layer's dense pieces, between attention and the row-parallel layers: eager
(torch) and fused (the C++ passes of a CPU worker on the C++ attention backend), and the fused
CPU paths a family may opt into."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from spmd_runtime.runtime.layers.attention_backend import AttentionBackend
from spmd_runtime.runtime.layers.bf16_panels import panel_silu_product
from spmd_runtime.runtime.layers.group_quant import silu_gated_product
from spmd_runtime.runtime.layers.linear import linear
from spmd_runtime.runtime.layers.norm import rms_norm
from spmd_runtime.runtime.layers.rotary import apply_rotary


def attention_inputs(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused QKV projection, (with `qk_norm`, the query and key norm weights: per-head
    RMSNorm of q and k) and rotary embedding: q [T, heads, dim], k and v [T, kv, dim]."""
    qkv = linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                        dim=-1)
    q, k = q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], eps), rms_norm(k, qk_norm[1], eps)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v.view(-1, num_kv_heads, head_dim)


def gate_and_up(x: torch.Tensor, attention_output: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, gate_up_weight: torch.Tensor,
                intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual, norm and gate/up projection: (new residual, gate, up)."""
    x = x + attention_output
    gate, up = linear(rms_norm(x, norm_weight, eps), gate_up_weight).split(intermediate_size, dim=-1)
    return x, gate, up


def mlp_inputs(x: torch.Tensor, attention_output: torch.Tensor, norm_weight: torch.Tensor,
               eps: float, gate_up_weight: torch.Tensor,
               intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual, norm, gate/up projection and SwiGLU: (new residual, input of the down
    projection)."""
    x, gate, up = gate_and_up(x, attention_output, norm_weight, eps, gate_up_weight,
                              intermediate_size)
    return x, F.silu(gate) * up


@dataclass(frozen=True)
class LayerPieces:
    """A decoder layer's dense computation between attention and the row-parallel layers.

    Attention and the row-parallel projections (attention output, MLP down) run eagerly between
    these pieces: attention because its shapes follow the requests' contexts, the row-parallel
    layers because their all-reduces are launched chunk by chunk to overlap the next matmul.
    Compiled or captured pieces thus depend on the token count alone."""

    attention_inputs: Callable = attention_inputs
    mlp_inputs: Callable = mlp_inputs


EAGER = LayerPieces()


def fused_attention_inputs(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                           cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                           num_kv_heads: int, head_dim: int,
                           qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_inputs with the norm and the rotary embedding as single C++ passes (float32 or
    bfloat16 CPU, runtime/layers/cpu_layers.cpp): rotary runs in place on the query and key columns.
    The C++ passes have no query/key norm: with one, the eager attention_inputs runs."""
    if qk_norm is not None:
        return attention_inputs(x, norm_weight, eps, qkv_weight, qkv_bias, cos, sin, num_heads,
                                num_kv_heads, head_dim, qk_norm)
    qkv = linear(torch.ops.spmd_cpu.rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    torch.ops.spmd_cpu.rotary_(qkv, num_heads + num_kv_heads, head_dim,
                               cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                        dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


def fused_mlp_inputs(x: torch.Tensor, attention_output: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, gate_up_weight: torch.Tensor,
                     intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mlp_inputs with the residual add and the norm as one C++ pass, and SiLU x up as another
    (float32 or bfloat16 CPU), or in the gate/up product's tiles (GGUF blocks, a prompt's bf16
    rows: group_quant.silu_gated_product; bf16 panels, any rows: bf16_panels.panel_silu_product)."""
    x, normed = torch.ops.spmd_cpu.add_rms_norm(x, attention_output, norm_weight, eps)
    activation = panel_silu_product(normed, gate_up_weight)
    if activation is None:
        activation = silu_gated_product(normed, gate_up_weight)
    if activation is None:
        activation = torch.ops.spmd_cpu.silu_mul(linear(normed, gate_up_weight))
    return x, activation


# The eager pieces of a CPU worker on the C++ attention backend (runtime/layers/cpu_ops.py).
FUSED_CPU = LayerPieces(fused_attention_inputs, fused_mlp_inputs)
# The fused CPU paths a family may opt into (LlamaForCausalLM.fused_cpu_paths).
LAYER_PASSES, LAYER_STACK = "layer_passes", "layer_stack"


def fused_cpu_paths_of(family: type) -> frozenset[str]:
    """The fused CPU paths `family` declares itself (in its own class body); none otherwise."""
    return family.__dict__.get("fused_cpu_paths", frozenset())


def eager_pieces(attention: AttentionBackend) -> LayerPieces:
    """FUSED_CPU where the worker's attention backend has the fused passes, EAGER elsewhere."""
    return FUSED_CPU if attention.fused_layers else EAGER
