"""A lone prompt's layer stack in one C++ call (runtime/models/prompt_stack.py,
cpu_prompt_layers.cpp): the same hidden states and cache contents as the layer loop, to the
bit, for each weight form and dtype it takes; the steps it leaves to the loop; the arguments it
refuses before writing a cache."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cpu_library import needs_bf16_tiles, needs_int8_blocks
from cpu_library import needs_cpu_ops as needs_ops
from spmd_runtime.runtime.layers.attention import AttentionBatch, DecodeGroup, PrefillChunk
from spmd_runtime.runtime.layers.attention_backend import CPP, TORCH
from spmd_runtime.runtime.models.prompt_stack import prompt_stack
from test_fused_layers import (
    assert_forward_is_the_layer_loop,
    gguf_tiny_model,
    packed_tiny_model,
    tiny_model,
)

BLOCK = 16


def prompt_batch(config, length: int, context: int, dtype: torch.dtype):
    """Random caches and one prompt chunk of `length` tokens after `context` cached ones (0: a
    fresh prompt), its blocks scattered over the cache as the scheduler may leave them."""
    num_blocks = 2 * -(-(context + length) // BLOCK) + 3
    shape = (num_blocks * BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
              for _ in range(config.num_hidden_layers)]
    table = torch.randperm(num_blocks)[:-(-(context + length) // BLOCK)]
    positions = torch.arange(context, context + length)
    slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
    chunk = PrefillChunk(0, length, table.to(torch.int32) if context else None, None,
                         first_key=0, position=context)
    batch = AttentionBatch(block_size=BLOCK, slot_mapping=slots, decodes=[], prefills=[chunk],
                           backend=CPP)
    return caches, batch, positions


def assert_stack_is_the_layer_loop(model, config, length: int, context: int,
                                   epilogues: tuple[bool, bool]) -> None:
    """The model's forward (the stack, then the last layer) against every layer through the
    loop, on copies of the same random caches: the same hidden states and caches, exactly.
    epilogues: the stack's (SiLU x up, residual) in the products' epilogues."""
    dtype = model.embed_tokens.dtype
    caches, batch, positions = prompt_batch(config, length, context, dtype)
    ids = torch.randint(0, config.vocab_size, (length,))
    stack = prompt_stack(model, batch, model.embed_tokens[ids])
    assert stack is not None
    assert (stack.silu_in_product, stack.residual_in_product) == epilogues
    assert_forward_is_the_layer_loop(model, ids, positions, caches, batch)


@needs_bf16_tiles
@pytest.mark.parametrize("context", [0, 40])
@pytest.mark.parametrize("length,epilogues", [(20, (False, True)), (64, (True, True))])
@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q8_0"])
def test_gguf_prompt_stack_equals_the_layer_loop_to_the_bit(tensor_type, length, epilogues,
                                                           context) -> None:
    """bfloat16 (assertions on bf16 hidden states and caches): GGUF blocks through
    gguf_bf16_linear, with the residual in the down projection's product and, past 48 rows,
    SiLU x up in the gate/up one, as the loop puts them there; fresh prompts and chunks over
    cached context."""
    from gguf import GGMLQuantizationType as GGML

    model, config = gguf_tiny_model(GGML[tensor_type])
    assert_stack_is_the_layer_loop(model, config, length, context, epilogues)


@needs_int8_blocks
def test_int8_gguf_prompt_stack_equals_the_layer_loop_to_the_bit() -> None:
    """bfloat16 (assertions on bf16 hidden states and caches): --quantization int8's products
    on 8-bit activations, with their own epilogues (SiLU x up from 33 rows, the residual)."""
    from gguf import GGMLQuantizationType as GGML
    from spmd_runtime.runtime.layers.quantization import quantize_linear_weights

    model, config = gguf_tiny_model(GGML.Q4_1)
    quantize_linear_weights(model, "int8")
    assert_stack_is_the_layer_loop(model, config, 64, 0, (False, False))


@needs_bf16_tiles
@pytest.mark.parametrize("context", [0, 24])
def test_bf16_prompt_stack_equals_the_layer_loop_to_the_bit(context) -> None:
    """bfloat16 (assertions on bf16 hidden states and caches): plain [out, in] weights."""
    model, config = tiny_model(3, torch.bfloat16)
    assert_stack_is_the_layer_loop(model, config, 33, context, (False, False))


@needs_ops
def test_float32_prompt_stack_equals_the_layer_loop_and_leaves_cached_context_to_it() -> None:
    """float32 (assertions on float32 hidden states and caches): MKL-packed projections on a
    fresh prompt; a chunk over cached context attends through SDPA in float32, so the loop
    runs it."""
    model, config = packed_tiny_model()
    assert_stack_is_the_layer_loop(model, config, 37, 0, (False, False))
    _, batch, _ = prompt_batch(config, 8, 16, torch.float32)
    assert prompt_stack(model, batch, torch.zeros(8, config.hidden_size)) is None


@needs_ops
def test_prompt_stack_runs_only_for_a_lone_prompt_of_one_window() -> None:
    model, config = packed_tiny_model()
    _, batch, _ = prompt_batch(config, 12, 0, torch.float32)
    x = torch.zeros(12, config.hidden_size)
    assert prompt_stack(model, batch, x) is not None
    group = DecodeGroup(12, 1, torch.zeros(1, dtype=torch.int32), None,
                        torch.ones(1, dtype=torch.int32))
    chunk = batch.prefills[0]
    two = [replace(chunk, length=6), replace(chunk, start=6, length=6)]
    for other in (replace(batch, decodes=[group]), replace(batch, prefills=two),
                  replace(batch, backend=TORCH), replace(batch, pad_start=10),
                  replace(batch, window=8)):
        assert prompt_stack(model, other, x) is None
    assert prompt_stack(model, batch, torch.zeros(13, config.hidden_size)) is None
    one_layer, _ = packed_tiny_model(layers=1)
    assert prompt_stack(one_layer, batch, x) is None          # the last layer is the loop's
    model.layers[1].self_attn.o_bias = torch.nn.Parameter(torch.zeros(config.hidden_size),
                                                          requires_grad=False)
    assert prompt_stack(model, batch, x) is None


def _stack_args(context: int = 16):
    """prompt_layers' arguments for a bf16 Q8_0 model's prompt of 64 tokens."""
    from gguf import GGMLQuantizationType as GGML

    model, config = gguf_tiny_model(GGML.Q8_0)
    caches, batch, positions = prompt_batch(config, 64, context, torch.bfloat16)
    x = model.embed_tokens[torch.randint(0, config.vocab_size, (64,))]
    stack = prompt_stack(model, batch, x)
    cos, sin = (t.view(64, -1) for t in model.rotary.tables(positions))
    chunk = batch.prefills[0]
    attn = model.layers[0].self_attn
    return {"x": x, "weights": stack.weights, "k_caches": [c[0] for c in caches[:-1]],
            "v_caches": [c[1] for c in caches[:-1]], "cos": cos, "sin": sin,
            "slots": batch.slot_mapping, "context_blocks": chunk.context_blocks,
            "first_key": 0, "position": context, "block_size": BLOCK, "scale": attn.scale,
            "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
            "head_dim": attn.head_dim, "eps": 1e-5, "window": 0, "silu_in_product": True,
            "residual_in_product": True}


def _spoil(name, value_of):
    return lambda a: {**a, name: value_of(a)}


def _plain_gate_up(a):
    weights = list(a["weights"])
    weights[16] = torch.zeros(192, 128, dtype=torch.bfloat16)       # layer 1's gate/up
    return {**a, "weights": weights}


# id -> (what spoils _stack_args(), the message prompt_layers must raise)
BAD_STACK_ARGS = {
    "window negative": (_spoil("window", lambda a: -1), "prompt_layers: window -1 must be >= 0"),
    "block outside the cache": (
        _spoil("context_blocks", lambda a: torch.full_like(a["context_blocks"], 10_000)),
        r"prompt_layers: blocks\[0\] = 10000 is outside the cache's"),
    "table too short": (_spoil("context_blocks", lambda a: a["context_blocks"][:2]),
                        "prompt_layers: the chunk's keys reach 80 tokens"),
    "fresh at a position": (_spoil("context_blocks", lambda a: None),
                            "prompt_layers: a fresh prompt .* starts at position 0"),
    "epilogue on a plain weight": (_plain_gate_up,
                                   r"prompt_layers: weights\[16\] \(layer 1 gate/up packed\) "
                                   "must be GGUF blocks"),
    "slots rows": (_spoil("slots", lambda a: a["slots"][:3]), "prompt_layers: slots has 3 rows"),
    "layers": (_spoil("k_caches", lambda a: a["k_caches"][:1]),
               "prompt_layers: 1 k_caches and 2 v_caches"),
}


@needs_bf16_tiles
@pytest.mark.parametrize("case", BAD_STACK_ARGS, ids=list(BAD_STACK_ARGS))
def test_prompt_layers_refuse_bad_arguments_before_writing_a_cache(case) -> None:
    spoil, message = BAD_STACK_ARGS[case]
    args = spoil(_stack_args())
    before = [c.clone() for c in args["k_caches"]]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.spmd_cpu.prompt_layers(*args.values())
    assert all(torch.equal(c, b) for c, b in zip(args["k_caches"], before, strict=True))
