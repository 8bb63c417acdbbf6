"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head) over a paged KV cache."""
from __future__ import annotations

from collections.abc import Callable

import torch
from spmd_runtime.protocol.model_config import ModelConfig, optional_bias_shapes, weight_shapes
from spmd_runtime.runtime.layers.attention import (
    AttentionBatch,
    fresh_prompt_batch,
    paged_attention,
)
from spmd_runtime.runtime.layers.attention_backend import AttentionBackend
from spmd_runtime.runtime.layers.group_quant import assign_weight, stack_rows
from spmd_runtime.runtime.layers.int8_blocks import Int8BlocksHead
from spmd_runtime.runtime.layers.linear import decode_layers_slots, logits_linear
from spmd_runtime.runtime.layers.norm import RMSNorm
from spmd_runtime.runtime.layers.parallel import (
    ShardLayout,
    TensorParallel,
    read_shard,
    residual_row_parallel_linear,
    row_parallel_linear,
    vocab_parallel_embedding,
)
from spmd_runtime.runtime.layers.rotary import RotaryEmbedding
from spmd_runtime.runtime.models.layer_pieces import (
    EAGER,
    FUSED_CPU,
    LAYER_PASSES,
    LAYER_STACK,
    LayerPieces,
    eager_pieces,
    fused_cpu_paths_of,
)
from spmd_runtime.runtime.models.prompt_stack import prompt_stack, run_prompt_stack
from torch import nn


def _linear_weight(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class LlamaAttention(nn.Module):
    """This rank's attention weights: its query heads and their KV heads (column-parallel
    QKV), and the matching input columns of the output projection (row-parallel)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shards: ShardLayout) -> None:
        super().__init__()
        self.num_heads = shards.num_heads
        self.num_kv_heads = shards.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Q, K and V share one matmul: one large GEMM beats three small ones.
        self.qkv_proj = _linear_weight(self.q_size + 2 * self.kv_size, config.hidden_size, dtype)
        self.qkv_bias: nn.Parameter | None = None
        self.o_proj = _linear_weight(config.hidden_size, self.q_size, dtype)
        self.o_bias: nn.Parameter | None = None
        # Per-head RMSNorm of queries and keys before the rotary embedding (Qwen3), if loaded.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.scale = self.head_dim ** -0.5
        self.softcap: float | None = None     # soft-cap of the attention scores (Gemma 2)


class LlamaMLP(nn.Module):
    """This rank's slice of the MLP features: gate/up rows (column-parallel), down columns
    (row-parallel)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shards: ShardLayout) -> None:
        super().__init__()
        self.intermediate_size = shards.intermediate_size
        self.gate_up_proj = _linear_weight(2 * self.intermediate_size, config.hidden_size, dtype)
        self.down_proj = _linear_weight(config.hidden_size, self.intermediate_size, dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shards: ShardLayout,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, dtype, shards)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, shards)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                pieces: LayerPieces, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output rows: all of x's, or with `keep` (row indices) those rows alone,
        in its order (every row's keys and values are still written to the cache)."""
        mlp = self.mlp
        attention_output = self.attend(x, rope, kv_cache, batch, pieces, keep)
        x = x if keep is None else x[keep]
        x, activation = pieces.mlp_inputs(
            x, attention_output, self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps, mlp.gate_up_proj, mlp.intermediate_size)
        return residual_row_parallel_linear(x, activation, mlp.down_proj, self.tp)

    def attend(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
               pieces: LayerPieces, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output (all-reduced over the ranks), before the residual: of
        every row, or of the rows `keep` indexes (projected out for them alone)."""
        attn = self.self_attn
        qk_norm = None if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
        q, k, v = pieces.attention_inputs(
            x, self.input_layernorm.weight, self.input_layernorm.eps, attn.qkv_proj,
            attn.qkv_bias, *rope, attn.num_heads, attn.num_kv_heads, attn.head_dim, qk_norm)
        attended = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, attn.scale,
                                   attn.softcap)
        attended = attended.reshape(x.shape[0], -1)
        attended = attended if keep is None else attended[keep]
        return row_parallel_linear(attended, attn.o_proj, attn.o_bias, self.tp)


class LlamaForCausalLM(nn.Module):
    """The whole model, or with tensor parallelism (tp.size > 1) this rank's shard of it."""

    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # The layers' dense pieces, eager (what --execution-mode compiled compiles).
    pieces: LayerPieces = EAGER
    # The fused CPU paths this family's layers compute exactly: LAYER_PASSES (FUSED_CPU, a
    # layer's norm, rotary and SiLU x up in C++) and LAYER_STACK (every layer of a decode step,
    # and all but the last of a lone prompt's, in one C++ call). Opt-in: a family class that
    # does not declare its own runs neither, even if it inherits a class that does
    # (fused_cpu_paths_of).
    fused_cpu_paths: frozenset[str] = frozenset({LAYER_PASSES, LAYER_STACK})

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.shards = ShardLayout.of(config, tp)
        vocab_rows = self.shards.vocab_per_rank
        self.embed_tokens = nn.Parameter(
            torch.empty(vocab_rows, config.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(self.decoder_layer(config, dtype, self.shards, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else nn.Parameter(
            torch.empty(vocab_rows, config.hidden_size, dtype=dtype), requires_grad=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, dtype)
        # Each layer's sliding window (None: full attention).
        self.layer_windows = [config.window_of(i) for i in range(config.num_hidden_layers)]

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, tuple[int, ...]]]:
        """Names and shapes of the tensors a Hugging Face checkpoint of this family holds: those
        it must hold, and those it may hold besides (attention biases)."""
        biases = optional_bias_shapes(config)
        return {**weight_shapes(config), **(biases if config.attention_bias else {})}, biases

    @staticmethod
    def stacked_tensors(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
        """Checkpoint tensors that stack several of the names load_hf_state_dict takes along
        their rows: name -> [(part name, rows), ...] (none in Llama checkpoints)."""
        return {}

    @staticmethod
    def shard_spec(config: ModelConfig, tp: TensorParallel) -> ShardSpec:
        """This rank's shard of each checkpoint tensor (see llama_shard_spec)."""
        return llama_shard_spec(config, tp)

    def projection_slots(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every decoder-layer projection weight: attention QKV and
        output, MLP gate/up and down (what packing and quantization replace)."""
        return [(module, name) for layer in self.layers
                for module, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                     (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"))]

    def layer_pieces(self, attention: AttentionBackend) -> LayerPieces:
        """The eager pieces this model's layers run with that attention backend: the fused C++
        passes where the backend has them and the family opted in, else its own."""
        if LAYER_PASSES in fused_cpu_paths_of(type(self)):
            return eager_pieces(attention)
        return self.pieces

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [T, hidden] (every rank's vocabulary shard summed)."""
        return vocab_parallel_embedding(input_ids, self.embed_tokens, self.shards.vocab_start,
                                        self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                batch: AttentionBatch, pieces: LayerPieces | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened batch, after the final norm. `pieces`
        computes the layers' dense parts (eager, or compiled for the batch's shape; by default
        the family's eager `pieces`). keep: the row indices whose hidden states are read (the
        rows sampled), or None for all: then the last layer's output projection and MLP run
        for those rows alone, and the result is [len(keep), hidden] in keep's order (a
        512-token prompt's last layer is ~1/36 of its step, all but its QKV and attention)."""
        pieces = pieces or self.pieces
        x = self.embed(input_ids)
        ropes = self.layer_ropes(positions)
        weights = self.fused_decode_weights(batch, x.shape[0]) if pieces is FUSED_CPU else None
        if weights is not None:
            hidden = self.norm(self._fused_decode(x, ropes[0], kv_caches, batch, weights))
            return hidden if keep is None else hidden[keep]
        last, first = len(self.layers) - 1, 0
        stack = prompt_stack(self, batch, x) if pieces is FUSED_CPU else None
        if stack is not None:           # a lone prompt: all but the last layer in one call
            x, first = run_prompt_stack(self, x, ropes[0], kv_caches, batch, stack), last
        for index, (layer, kv_cache, rope, window) in enumerate(zip(
                self.layers, kv_caches, ropes, self.layer_windows, strict=True)):
            if index >= first:
                x = layer(x, rope, kv_cache, batch.for_window(window), pieces,
                          keep if index == last else None)
        return self.norm(x)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rotary cos/sin tables at `positions` (one table shared by all here)."""
        return [self.rotary.tables(positions)] * len(self.layers)

    def fused_decode_weights(self, batch: AttentionBatch,
                             num_tokens: int) -> list[torch.Tensor] | None:
        """The tensors spmd_cpu::decode_layers takes, where it can run this step: a batch of
        decodes alone (one C++-kernel group, no padding) on one rank, every projection packed
        for MKL (float32), a plain bfloat16 weight (its slot pair holds it twice) or GGUF
        blocks past their integer rows (the blocks and their type), without bias
        or query/key norm, and one window on every layer or none (the kernel's starts apply to
        all); None otherwise (the layer loop runs)."""
        windows = set(self.layer_windows)
        if windows != {None} and (len(windows) != 1 or not batch.backend.windowed_decode_stack):
            return None
        if (LAYER_STACK not in fused_cpu_paths_of(type(self)) or self.tp.size != 1
                or not batch.backend.fused_layers or batch.prefills
                or batch.prompt_rows or batch.pad_start is not None or len(batch.decodes) != 1
                or batch.decodes[0].count != num_tokens):
            return None
        # The list depends on the row count alone (decode_layers_slots) while the projections
        # stay the same objects: built once per row count (~0.3 ms a step at SmolLM2's 30
        # layers), all again once the first layer's QKV or the last layer's down projection is
        # another object (quantizing or packing swaps every projection, those two included).
        marks = (self.layers[0].self_attn.qkv_proj, self.layers[-1].mlp.down_proj)
        held = self.__dict__.get("_decode_weights_by_rows")
        if held is None or held[0][0] is not marks[0] or held[0][1] is not marks[1] \
                or len(held[1]) > 1024:     # (a swap: no list of the old weights kept)
            held = self.__dict__["_decode_weights_by_rows"] = (marks, {})
        lists = held[1]
        if num_tokens not in lists:
            lists[num_tokens] = self._decode_layer_weights(num_tokens)
        return lists[num_tokens]

    def _decode_layer_weights(self, num_tokens: int) -> list[torch.Tensor] | None:
        """fused_decode_weights' list at `num_tokens` rows, the batch aside."""
        weights = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.qkv_bias is not None or attn.o_bias is not None or attn.q_norm is not None:
                return None
            slots = [decode_layers_slots(p, num_tokens) for p in projections]
            if any(slot is None for slot in slots):
                return None
            (qkv, o, gate_up, down) = slots
            weights += (layer.input_layernorm.weight, *qkv, *o,
                        layer.post_attention_layernorm.weight, *gate_up, *down)
        return weights

    def _fused_decode(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
                      weights: list[torch.Tensor]) -> torch.Tensor:
        """Every layer of a decode step in one C++ call: the operators of the layer loop's
        FUSED_CPU path in the same order (the same hidden states), without its host time."""
        group, attn = batch.decodes[0], self.layers[0].self_attn
        cos, sin = (table.view(table.shape[0], -1) for table in rope)
        starts = group.starts           # under a window on every layer
        return torch.ops.spmd_cpu.decode_layers(
            x, weights, [cache[0] for cache in kv_caches], [cache[1] for cache in kv_caches],
            cos, sin, batch.slot_mapping, group.blocks.view(group.count, -1), group.lengths,
            batch.block_size, attn.scale, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.layers[0].input_layernorm.eps, *([] if starts is None else [starts]))

    @torch.no_grad()
    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """Float logits [len(ids), vocab] at every position of one fresh prompt (causal, no cached
        context), through a scratch KV cache of its own: for evaluation tools, not serving."""
        n, config = len(ids), self.config
        kv_heads = self.shards.num_kv_heads
        caches = [(torch.zeros(n, kv_heads, config.head_dim, dtype=self.embed_tokens.dtype),
                   torch.zeros(n, kv_heads, config.head_dim, dtype=self.embed_tokens.dtype))
                  for _ in range(config.num_hidden_layers)]
        batch = fresh_prompt_batch(n, self.layer_windows)
        return self.compute_logits(self(torch.tensor(ids), torch.arange(n), caches, batch))

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Full-vocabulary logits on every rank (shards gathered), so all ranks sample alike:
        float32, or with float32=False in the model's dtype, for greedy choices alone (widening
        is exact, so the largest logit stays where it is; 64 x 49,152 bf16 logits took 2.3 ms to
        widen, ~5% of a SmolLM2 decode step on 2 cores). A GGUF head gives float32 logits in
        either case (logits_linear)."""
        logits = self.tp.gather_last_dim(logits_linear(hidden, self.lm_head))
        logits = logits[..., :self.config.vocab_size]
        return logits.float() if float32 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token (the first index of compute_logits' largest) straight from a
        head that gives it without the logits (an int8 GGUF head on one rank whose features are
        the vocabulary: Int8BlocksHead.greedy_tokens); None for any other head."""
        head = self.lm_head
        if isinstance(head, Int8BlocksHead) and self.tp.size == 1 and \
                head.shape[0] == self.config.vocab_size:
            return head.greedy_tokens(hidden)
        return None

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of weights named as in Hugging Face Llama checkpoints, fusing
        QKV and gate/up. Weights may be whole (they are sliced here) or this rank's shards
        already (a loader that read only them, see llama_shard_spec). Each weight is dropped from
        `weights` once copied, so the checkpoint and the model are not both held whole: a
        worker's memory peaks near one copy of the weights, not two."""
        spec = self.shard_spec(self.config, self.tp)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name}")
            tensor, shard = weights.pop(name), spec(name)
            if shard is not None and tensor.shape[shard[0]] == shard[2]:
                return tensor           # a loader read only this rank's shard
            return read_shard(tensor, shard)

        assign_weight(self, "embed_tokens", take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            assign_weight(self, "lm_head", take("lm_head.weight"))
        elif not isinstance(self.embed_tokens, torch.Tensor):    # the table, kept in blocks
            assign_weight(self, "lm_head", self.embed_tokens)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn = layer.self_attn
            assign_weight(attn, "qkv_proj", stack_rows([take(prefix + f"self_attn.{p}_proj.weight")
                                                        for p in "qkv"]))
            if prefix + "self_attn.q_proj.bias" in weights:
                attn.qkv_bias = _loaded(torch.cat(
                    [take(prefix + f"self_attn.{p}_proj.bias") for p in "qkv"]), attn.qkv_proj)
            assign_weight(attn, "o_proj", take(prefix + "self_attn.o_proj.weight"))
            if prefix + "self_attn.o_proj.bias" in weights:
                attn.o_bias = _loaded(take(prefix + "self_attn.o_proj.bias"), attn.o_proj)
            if prefix + "self_attn.q_norm.weight" in weights:
                attn.q_norm, attn.k_norm = (
                    RMSNorm(attn.head_dim, self.config.rms_norm_eps, attn.qkv_proj.dtype)
                    for _ in range(2))
                attn.q_norm.weight.copy_(take(prefix + "self_attn.q_norm.weight"))
                attn.k_norm.weight.copy_(take(prefix + "self_attn.k_norm.weight"))
            assign_weight(layer.mlp, "gate_up_proj", stack_rows([take(prefix + "mlp.gate_proj.weight"),
                                                                 take(prefix + "mlp.up_proj.weight")]))
            assign_weight(layer.mlp, "down_proj", take(prefix + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(prefix + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(
                take(prefix + "post_attention_layernorm.weight"))


def _loaded(tensor: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    """A weight the checkpoint may or may not carry (a bias), in `like`'s dtype."""
    return nn.Parameter(tensor.to(like.dtype), requires_grad=False)


ShardSpec = Callable[[str], "tuple[int, int, int] | None"]


def llama_shard_spec(config: ModelConfig, tp: TensorParallel) -> ShardSpec:
    """For a Hugging Face Llama weight name: (dimension, start, count) of this rank's shard
    (rows of column-parallel layers and of the vocabulary, columns of row-parallel layers), or
    None for weights every rank holds whole (the norms)."""
    shards, head_dim = ShardLayout.of(config, tp), config.head_dim
    q = (shards.q_head_start * head_dim, shards.num_heads * head_dim)
    kv = (shards.kv_head_start * head_dim, shards.num_kv_heads * head_dim)
    mlp = (tp.rank * shards.intermediate_size, shards.intermediate_size)
    vocab = (shards.vocab_start, shards.vocab_per_rank)
    rules = {"q_proj": (0, *q), "k_proj": (0, *kv), "v_proj": (0, *kv), "o_proj": (1, *q),
             "gate_proj": (0, *mlp), "up_proj": (0, *mlp), "down_proj": (1, *mlp),
             "embed_tokens": (0, *vocab), "lm_head": (0, *vocab)}

    def spec(name: str) -> tuple[int, int, int] | None:
        parts = name.split(".")
        rule = rules.get(parts[-2]) if len(parts) >= 2 else None
        # A row-parallel layer's bias is added whole, once, after the reduction.
        return None if rule is None or (rule[0] == 1 and parts[-1] == "bias") else rule

    return spec
