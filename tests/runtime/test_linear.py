"""The CPU dense projection (runtime/layers/linear.py): oneDNN with a bounded set of shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spmd_runtime.runtime.layers import linear as linear_mod
from spmd_runtime.runtime.layers.linear import ONEDNN_EXACT_ROWS, ONEDNN_ROW_MULTIPLE, linear


@pytest.mark.skipif(linear_mod._onednn_linear is None, reason="this torch has no oneDNN linear")
def test_onednn_meets_few_shapes_and_computes_the_same_product(monkeypatch) -> None:
    """Every row count gives F.linear's product; oneDNN sees row counts up to the decode bound
    exactly and longer inputs padded to a multiple, so its primitive caches stay small."""
    seen = []
    real = linear_mod._onednn_linear

    def recording(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(linear_mod, "_onednn_linear", recording)
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    for rows in (1, 7, ONEDNN_EXACT_ROWS, ONEDNN_EXACT_ROWS + 1, 100, 128, 129, 300, 1000):
        x = torch.randn(rows, 40)
        out = linear(x, weight, bias)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    long_inputs = [rows for rows in seen if rows > ONEDNN_EXACT_ROWS]
    assert long_inputs and all(rows % ONEDNN_ROW_MULTIPLE == 0 for rows in long_inputs), seen


@pytest.mark.skipif(not linear_mod.can_pack(torch.device("cpu"), torch.float32),
                    reason="this torch has no MKL packed GEMM")
@pytest.mark.parametrize("mkl", [True, False], ids=["mkl", "onednn"])
def test_packed_weight_computes_the_same_product_at_every_row_count(mkl) -> None:
    """float32: one weight packed for MKL (Intel's default) or oneDNN (other CPUs') serves any
    number of rows (each call names its own), with and without bias, for 3-D and strided
    inputs."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    packed = linear_mod.PackedWeight.pack(weight, mkl=mkl)
    assert packed.onednn != mkl
    assert packed.shape == weight.shape
    for rows in (1, 2, 7, 63, 64, 65, 300, 1000):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(3, 5, 100)[..., :40]
    torch.testing.assert_close(linear(strided, packed), F.linear(strided, weight),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not linear_mod.can_pack(torch.device("cpu"), torch.float32),
                    reason="this torch has no MKL packed GEMM")
def test_packing_a_model_keeps_its_logits_and_counts_its_bytes() -> None:
    model, config = tiny_tied_llama(torch.float32)
    ids = torch.randint(0, 300, (20,)).tolist()
    plain_bytes = linear_mod.weight_bytes(model)
    expected = model.prompt_logits(ids)
    assert linear_mod.pack_linear_weights(model) == 4 * config.num_hidden_layers + 1
    torch.testing.assert_close(model.prompt_logits(ids), expected, rtol=1e-4, atol=1e-4)
    # The packed forms replace the projections (MKL's: 2-4x their bytes; oneDNN's: theirs); the
    # tied table stays.
    assert linear_mod.weight_bytes(model) >= plain_bytes


BF16_PACKING = linear_mod.can_pack(torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not BF16_PACKING, reason="oneDNN computes no bfloat16 on this CPU (no AVX-512)")
def test_bf16_packed_weight_gives_the_plain_weights_bits_at_decode_row_counts() -> None:
    """bfloat16 (assertions on bf16 products): oneDNN's prepacked weight computes, bit for bit,
    what oneDNN computes on the plain weight up to a few hundred rows (decode steps and the
    packing's row hint), with and without bias, for 3-D and strided inputs. Past that, an AMX
    CPU blocks the two differently: at 1,000 rows an element may round the other way (one bf16
    step, seen on an Intel Xeon with AMX on 2026-11-26), so there both stay within bf16's
    rounding of each other."""
    torch.manual_seed(0)
    weight, bias = (torch.randn(96, 40) * 0.1).bfloat16(), torch.randn(96).bfloat16()
    packed = linear_mod.PackedWeight.pack(weight)
    assert packed.shape == weight.shape and packed.stand_in.dtype == torch.bfloat16
    for rows in (1, 2, 7, 63, 64, 65, 300):
        x = torch.randn(rows, 40).bfloat16()
        assert torch.equal(linear(x, packed, bias), linear(x, weight, bias))
        assert torch.equal(linear(x, packed), linear(x, weight))
    strided = torch.randn(3, 5, 100).bfloat16()[..., :40]
    assert torch.equal(linear(strided, packed), linear(strided, weight))
    x = torch.randn(1000, 40).bfloat16()
    exact = F.linear(x.float(), weight.float(), bias.float())
    for got in (linear(x, packed, bias), linear(x, weight, bias)):
        # bf16's rounding of the float32 product (2^-8 relative; the absolute 2^-8 covers the
        # bias added after a rounding where the two nearly cancel), not a looser bound
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=2 ** -8)


@pytest.mark.skipif(not BF16_PACKING, reason="oneDNN computes no bfloat16 on this CPU (no AVX-512)")
def test_packing_a_bf16_model_for_onednn_keeps_its_logits_bits_and_its_bytes(monkeypatch) -> None:
    """bfloat16, oneDNN's layout (a CPU with AMX, or shapes the panels do not take): the
    projections are packed, the tied head stays the embedding table (no copy), the logits are
    the plain model's bits and the weights take the same bytes. (The panels' model:
    test_bf16_panels.py.)"""
    monkeypatch.setattr(linear_mod, "panels_take", lambda weight: False)
    model, config = tiny_tied_llama(torch.bfloat16)
    ids = torch.randint(0, 300, (20,)).tolist()
    plain_bytes = linear_mod.weight_bytes(model)
    expected = model.prompt_logits(ids)
    assert linear_mod.pack_linear_weights(model) == 4 * config.num_hidden_layers
    assert model.lm_head is model.embed_tokens
    assert isinstance(model.layers[0].self_attn.qkv_proj, linear_mod.PackedWeight)
    assert torch.equal(model.prompt_logits(ids), expected)
    assert linear_mod.weight_bytes(model) == plain_bytes


def tiny_tied_llama(dtype: torch.dtype):
    """A 2-layer Llama of 300 tokens with its head tied to the embedding, random weights."""
    from spmd_runtime.protocol.model_config import ModelConfig
    from spmd_runtime.runtime.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_ids=(0,))
    model = LlamaForCausalLM(config, dtype).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.1)
    return model, config
