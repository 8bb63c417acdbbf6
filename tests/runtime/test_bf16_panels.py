"""bfloat16 weights packed once at load into the C++ library's panels (runtime/layers/
bf16_panels.py, cpu_bf16_panels.cpp): the product against float32 arithmetic on the same bf16
values, a row's product whatever rows it is batched with, the SiLU x up and residual epilogues
against the separate passes, the model packed so (its bytes, its tied head, its logits), and the
arguments the operators refuse. Every assertion is about bfloat16 (the panels hold no other)."""
from __future__ import annotations

import pytest
import torch
from cpu_library import needs_bf16_tiles
from spmd_runtime.runtime.layers import bf16_panels
from spmd_runtime.runtime.layers import linear as linear_mod
from spmd_runtime.runtime.layers.bf16_panels import PanelWeight
from test_linear import tiny_tied_llama
from test_plain_bf16 import assert_product, operands

pytestmark = needs_bf16_tiles


def _ops():
    return torch.ops.spmd_cpu


def product(x, weight: PanelWeight):
    return _ops().bf16_panels_linear(x, weight.panels, weight.stand_in)


def test_the_library_says_which_shapes_it_packs() -> None:
    supported = _ops().bf16_panels_supported
    assert supported(576, 960) and supported(32, 32) and supported(1536, 576)
    assert not supported(576, 970) and not supported(570, 960) and not supported(0, 32)


# rows: one, a tile's 12, a partial tile on either side of it, several tiles and a tail;
# shapes: one panel, SmolLM2's QKV and down projection.
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 130])
def test_panels_product_is_the_float32_product_rounded(rows, out_features, in_features) -> None:
    x, w = operands(rows, out_features, in_features, seed=rows)
    assert_product(product(x, PanelWeight.pack(w)), x, w)


def test_a_rows_product_does_not_depend_on_the_rows_beside_it() -> None:
    """bf16, bit for bit: every row count runs the same sums in the same order."""
    x, w = operands(130, 960, 576, seed=3)
    packed = PanelWeight.pack(w)
    whole = product(x, packed)
    for first, count in ((0, 1), (7, 1), (0, 12), (5, 13), (100, 30)):
        assert torch.equal(product(x[first:first + count].contiguous(), packed),
                           whole[first:first + count])


def test_rows_taken_in_blocks_are_the_rows_taken_whole() -> None:
    """bf16, bit for bit: from 768 rows on each thread takes the rows 252 at a time (a prompt
    step's); every row's sums are those of the same rows taken whole, fewer at a time."""
    x, w = operands(1000, 576, 1536, seed=5)
    packed = PanelWeight.pack(w)
    blocked = product(x, packed)
    for first, count in ((0, 500), (500, 500), (240, 30), (990, 10)):
        assert torch.equal(product(x[first:first + count].contiguous(), packed),
                           blocked[first:first + count])
    assert_product(blocked, x, w)


@pytest.mark.parametrize("rows", [1, 12, 40, 512, 800])
def test_epilogues_are_the_separate_passes_to_the_bit(rows) -> None:
    """bf16: SiLU x up in the gate/up product's tiles is silu_mul of the product, the residual
    in the down projection's is torch's bf16 add of the product, bit for bit."""
    x, gate_up = operands(rows, 3072, 576, seed=rows)
    packed = PanelWeight.pack(gate_up)
    assert torch.equal(_ops().bf16_panels_silu_linear(x, packed.panels, packed.stand_in),
                       _ops().silu_mul(product(x, packed)))
    assert torch.equal(bf16_panels.panel_silu_product(x, packed), _ops().silu_mul(product(x, packed)))
    activation, down = operands(rows, 576, 1536, seed=rows + 1)
    residual = torch.randn(rows, 576).bfloat16()
    packed = PanelWeight.pack(down)
    expected = residual + product(activation, packed)
    assert torch.equal(_ops().bf16_panels_residual_linear(activation, packed.panels,
                                                          packed.stand_in, residual), expected)
    assert torch.equal(bf16_panels.panel_residual_product(residual, activation, packed), expected)


def test_packing_a_bf16_model_holds_panels_in_the_weights_bytes() -> None:
    """bf16: the layers' projections become panels, the tied head stays the embedding table,
    the weights take the plain model's bytes, and the logits are the plain model's within bf16
    rounding (the sums' order differs from oneDNN's)."""
    model, config = tiny_tied_llama(torch.bfloat16)
    ids = torch.randint(0, 300, (20,)).tolist()
    plain_bytes = linear_mod.weight_bytes(model)
    plain_parameters = linear_mod.weight_parameters(model)
    expected = model.prompt_logits(ids)
    assert linear_mod.pack_linear_weights(model) == 4 * config.num_hidden_layers
    assert model.lm_head is model.embed_tokens
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PanelWeight)
    assert linear_mod.decode_layers_slots(qkv, 3) == (qkv.panels, qkv.stand_in)
    assert linear_mod.weight_bytes(model) == plain_bytes
    assert linear_mod.weight_parameters(model) == plain_parameters
    got = model.prompt_logits(ids)
    torch.testing.assert_close(got, expected, rtol=2 ** -6, atol=2 ** -6)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_panels_leave_amx_cpus_other_dtypes_and_shapes_to_onednn() -> None:
    """Which bf16 weights the panels hold; oneDNN keeps the rest."""
    weight = torch.randn(64, 64).bfloat16()
    assert bf16_panels.panels_take(weight, amx=False)
    assert not bf16_panels.panels_take(weight, amx=True)
    assert not bf16_panels.panels_take(weight.float(), amx=False)
    assert not bf16_panels.panels_take(torch.randn(70, 64).bfloat16(), amx=False)
    wide = bf16_panels.PANELS_MAX_IN_FEATURES
    assert bf16_panels.panels_take(torch.empty(32, wide, dtype=torch.bfloat16), amx=False)
    assert not bf16_panels.panels_take(torch.empty(32, wide + 32, dtype=torch.bfloat16), amx=False)


def _args():
    x, w = operands(4, 64, 32)
    packed = PanelWeight.pack(w)
    return {"x": x, "panels": packed.panels, "stand_in": packed.stand_in,
            "residual": torch.zeros(4, 64).bfloat16()}


BAD = {
    "x float32": (lambda a: _ops().bf16_panels_linear(a["x"].float(), a["panels"], a["stand_in"]),
                  "x must be a contiguous bfloat16"),
    "x features": (lambda a: _ops().bf16_panels_linear(torch.zeros(4, 64).bfloat16(), a["panels"],
                                                       torch.zeros(64, 64).bfloat16()),
                   "panels must be the contiguous int32 [2, 1024]"),
    "x width": (lambda a: _ops().bf16_panels_linear(torch.zeros(4, 96).bfloat16(), a["panels"],
                                                    a["stand_in"]), "x has 96 features"),
    "panels shape": (lambda a: _ops().bf16_panels_linear(a["x"], a["panels"][:1], a["stand_in"]),
                     "panels must be the contiguous int32 [2, 512]"),
    "panels dtype": (lambda a: _ops().bf16_panels_linear(a["x"], a["panels"].float(),
                                                         a["stand_in"]), "panels must be"),
    "odd shape": (lambda a: _ops().bf16_panels_linear(a["x"], a["panels"],
                                                      torch.zeros(63, 32).bfloat16()),
                  "multiples of 32"),
    "stand-in dtype": (lambda a: _ops().bf16_panels_linear(a["x"], a["panels"],
                                                           a["stand_in"].float()),
                       "stand_in must be bfloat16"),
    "residual shape": (lambda a: _ops().bf16_panels_residual_linear(
        a["x"], a["panels"], a["stand_in"], a["residual"][:3]), "residual must be a contiguous "
        "bfloat16 [4, 64]"),
    "pack float32": (lambda a: _ops().bf16_panels_pack(torch.zeros(64, 32)),
                     "weight must be bfloat16"),
    "pack shape": (lambda a: _ops().bf16_panels_pack(torch.zeros(40, 32).bfloat16()),
                   "multiples of 32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_panels_refuse_bad_arguments_naming_them(case) -> None:
    call, message = BAD[case]
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(_args())
