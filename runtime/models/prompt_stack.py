"""A lone prompt's layer stack in one C++ call (spmd_cpu::prompt_layers, cpu_prompt_layers.cpp):
where a step's rows are one prompt chunk, every layer but the last runs there, with the
operators and the bits of the layer loop's FUSED_CPU path, without the Python between them
(~2 ms a step on a 2-core VM, 1.5% of a 512-token SmolLM2 prompt). The last layer stays in
the loop, which projects and runs its MLP for the sampled rows alone."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from spmd_runtime.runtime.layers.attention import AttentionBatch, PrefillChunk
from spmd_runtime.runtime.layers.attention_backend import paged_prompt_supported
from spmd_runtime.runtime.layers.group_quant import silu_gated_part
from spmd_runtime.runtime.layers.linear import decode_layers_slots
from spmd_runtime.runtime.layers.parallel import residual_in_product
from spmd_runtime.runtime.models.layer_pieces import LAYER_STACK, fused_cpu_paths_of


@dataclass(frozen=True)
class PromptStack:
    """What prompt_layers takes for a step: every layer's but the last ten weight slots (the
    input norm, the four projections' slot pairs as decode_layers_slots gives them, the
    post-attention norm), and where the MLP's products take the GGUF bf16 epilogues."""

    weights: list[torch.Tensor]
    silu_in_product: bool
    residual_in_product: bool


def _lone_chunk(model, batch: AttentionBatch, x: torch.Tensor) -> PrefillChunk | None:
    """The step's one prompt chunk, if it is all the step's rows and the C++ prompt attention
    runs it (a fresh prompt where torch has MKL, cached context on the bf16 tiles); else None."""
    if batch.decodes or len(batch.prefills) != 1 or batch.prompt_rows is not None or \
            batch.pad_start is not None or not batch.backend.fused_layers:
        return None
    chunk = batch.prefills[0]
    if chunk.start != 0 or chunk.length != x.shape[0]:
        return None
    if chunk.context_blocks is None:
        return chunk if torch.backends.mkl.is_available() else None
    bf16 = x.dtype == torch.bfloat16
    return chunk if bf16 and paged_prompt_supported(model.config.head_dim) else None


def prompt_stack(model, batch: AttentionBatch, x: torch.Tensor) -> PromptStack | None:
    """The PromptStack for these embedded rows x [n, hidden], where prompt_layers can run the
    step: a family that opted into LAYER_STACK on one rank, a lone prompt chunk (_lone_chunk),
    one window (or none) on every layer, no bias, query/key norm or soft-cap, every projection
    in a form decode_layers_slots gives at n rows, and the same epilogues on every layer; None
    otherwise (the layer loop runs)."""
    layers = model.layers
    if LAYER_STACK not in fused_cpu_paths_of(type(model)) or model.tp.size != 1 or \
            len(layers) < 2 or set(model.layer_windows) != {batch.window} or \
            _lone_chunk(model, batch, x) is None:
        return None
    weights, epilogues = [], set()
    for layer in layers[:-1]:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_bias is not None or attn.o_bias is not None or attn.q_norm is not None or \
                attn.softcap is not None:
            return None
        slots = [decode_layers_slots(p, x.shape[0])
                 for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(slot is None for slot in slots):
            return None
        qkv, o, gate_up, down = slots
        weights += (layer.input_layernorm.weight, *qkv, *o,
                    layer.post_attention_layernorm.weight, *gate_up, *down)
        # The MLP's rows have x's count, dtype and device: the epilogues' conditions hold for
        # them as for x.
        epilogues.add((silu_gated_part(x, mlp.gate_up_proj) is not None,
                       residual_in_product(x, x, mlp.down_proj, model.tp) is not None))
    if len(epilogues) != 1:
        return None
    return PromptStack(weights, *epilogues.pop())


def run_prompt_stack(model, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
                     stack: PromptStack) -> torch.Tensor:
    """Every layer but the last on x [n, hidden] in one call: their output."""
    chunk, attn = batch.prefills[0], model.layers[0].self_attn
    cos, sin = (table.view(table.shape[0], -1) for table in rope)
    caches = kv_caches[:-1]
    return torch.ops.spmd_cpu.prompt_layers(
        x, stack.weights, [cache[0] for cache in caches], [cache[1] for cache in caches], cos,
        sin, batch.slot_mapping, chunk.context_blocks, chunk.first_key, chunk.position,
        batch.block_size, attn.scale, attn.num_heads, attn.num_kv_heads, attn.head_dim,
        model.layers[0].input_layernorm.eps, batch.window or 0, stack.silu_in_product,
        stack.residual_in_product)
