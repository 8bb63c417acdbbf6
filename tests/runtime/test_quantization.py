"""--quantization int8 (runtime/layers/quantization.py): the int8 projection against float32,
which weights it replaces, the options it refuses, and a real engine answering with it."""
from __future__ import annotations

import pytest
import torch
from cpu_library import needs_cpu_ops
from spmd_runtime.protocol.buckets import compiling
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime import LLM
from spmd_runtime.runtime.layers import quantization
from spmd_runtime.runtime.layers.linear import linear
from spmd_runtime.runtime.layers.quantization import (
    Int8Weight,
    RescoredInt8Head,
    int8_linear,
    int8_linear_reference,
    quantize_linear_weights,
)
from spmd_runtime.runtime.models.llama import LlamaForCausalLM


def tiny_model(seed: int) -> LlamaForCausalLM:
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, rope_theta=1000.0, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
    model = LlamaForCausalLM(config, torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + 0.2 * torch.randn(param.shape, generator=generator))
    return model


def test_weight_rounding_is_half_a_step_per_output_channel() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 32) * torch.logspace(-2, 1, 48)[:, None]     # channels of very different size
    q = Int8Weight.quantize(w, prepack=False)
    assert q.weight_t.dtype == torch.int8 and q.weight_t.shape == (32, 48) and q.shape == (48, 32)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()


def test_int8_linear_is_the_product_with_the_rounded_weights() -> None:
    """Activations lose (almost) nothing: the two int8 parts of each token leave the weights'
    rounding as the only error, even with an outlier channel that would crush one int8 part."""
    torch.manual_seed(1)
    x = torch.randn(5, 7, 64)
    x[..., 3] *= 50                                              # an outlier channel
    w, bias = torch.randn(40, 64) * 0.1, torch.randn(40)
    q = Int8Weight.quantize(w, prepack=False)
    out = int8_linear(x, q, bias)
    assert out.shape == (5, 7, 40) and out.dtype == torch.float32
    expected = x @ q.dequantize().t() + bias
    assert ((out - expected).norm() / expected.norm()).item() < 2e-4
    assert ((out - (x @ w.t() + bias)).norm() / expected.norm()).item() < 2e-2
    # A zero row (padding) gives exactly the bias; linear() dispatches on the weight's type.
    zeros = torch.zeros(3, 64)
    assert torch.equal(linear(zeros, q, bias), bias.expand(3, 40))


@needs_cpu_ops
def test_the_cpp_element_wise_ends_give_the_bits_of_the_torch_chain() -> None:
    torch.manual_seed(2)
    x = torch.randn(33, 96) * torch.logspace(-3, 2, 96)
    x[4] = 0.0                                                   # a padding row
    q = Int8Weight.quantize(torch.randn(50, 96))
    bias = torch.randn(50)
    assert torch.equal(int8_linear(x, q, bias), int8_linear_reference(x, q, bias))
    assert torch.equal(int8_linear(x[:1], q, None), int8_linear_reference(x[:1], q, None))
    # bfloat16 activations and bias (an int8 model over bf16) take the C++ ends too.
    x16, bias16 = x.bfloat16(), bias.bfloat16()
    assert int8_linear(x16, q, bias16).dtype == torch.bfloat16
    assert torch.equal(int8_linear(x16, q, bias16), int8_linear_reference(x16, q, bias16))


def test_quantizing_a_model_replaces_its_projections_and_keeps_its_predictions() -> None:
    model = tiny_model(seed=5)
    config = model.config
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    exact = model.prompt_logits(ids.tolist())
    lm_head = model.lm_head
    assert quantize_linear_weights(model, "none") == 0
    assert quantize_linear_weights(model, "int8") == 4 * config.num_hidden_layers + 1
    for layer in model.layers:
        for weight in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert isinstance(weight, Int8Weight)
    # The LM head: int8 scores, its float table (not a copy) for re-scoring the candidates.
    assert isinstance(model.lm_head, RescoredInt8Head) and model.lm_head.weight is not None
    assert model.lm_head.weight.data_ptr() == lm_head.data_ptr()
    quantized = model.prompt_logits(ids.tolist())
    # Per-channel int8 weights on random gaussian ones: ~3% logit error over two layers; a wrong
    # scale or layout would be off by far more.
    assert ((quantized - exact).norm() / exact.norm()).item() < 0.05
    assert (quantized.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.9
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linear_weights(model, "int3")


def test_a_bfloat16_model_keeps_its_bfloat16_head() -> None:
    """bfloat16: the projections go int8, the LM head stays the tied bf16 table (no int8 copy:
    --quantization int8 over bf16 holds about a byte per projection weight and nothing more)."""
    model = tiny_model(seed=5).to(torch.bfloat16)
    table = model.lm_head
    assert quantize_linear_weights(model, "int8") == 4 * model.config.num_hidden_layers
    assert model.lm_head is table and model.lm_head.dtype == torch.bfloat16
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model.prompt_logits(ids.tolist())).all()


def test_the_rescored_head_gives_float_logits_for_its_candidates() -> None:
    torch.manual_seed(3)
    table, hidden = torch.randn(300, 32), torch.randn(6, 32)
    head = RescoredInt8Head(Int8Weight.quantize(table), table, candidates=5)
    logits, exact = linear(hidden, head), hidden @ table.t()
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    rescored = (logits - exact).abs() < 1e-4          # the 5 candidates of each row, at least
    assert (rescored.sum(-1) >= 5).all() and rescored.gather(1, exact.argmax(-1, keepdim=True)).all()
    assert ((logits - exact).norm() / exact.norm()).item() < 0.02      # the rest: int8 scores


def test_int8_on_cuda_is_refused_with_what_to_change_and_compile_leaves_it_eager() -> None:
    with pytest.raises(ValueError, match="use --device cpu, or --quantization none or gguf on CUDA"):
        EngineConfig(quantization="int8", device="cuda")
    assert compiling(EngineConfig(execution_mode="compiled"))
    assert not compiling(EngineConfig(execution_mode="compiled", quantization="int8"))


def test_an_int8_engine_answers() -> None:
    """The default dtype (bf16 on an AVX512-BF16 CPU): the embedded file's blocks take 8-bit
    activations at every row count, a short prompt, a long one and the decode steps alike."""
    context = "France is a country in Western Europe, and its largest city is its seat of " \
              "government, known for the Eiffel Tower and the Louvre. " * 2
    with LLM("smollm2", quantization="int8", device="cpu", num_kv_blocks=256) as llm:
        outs = llm.generate(["The capital of France is", context + "The capital of France is"],
                            SamplingParams(max_tokens=4, temperature=0.0))
    for out in outs:
        assert out.text.strip().startswith("Paris"), out.text


@pytest.mark.skipif(not quantization._ONEDNN_INT8, reason="no exact oneDNN int8 linear here "
                    "(this torch lacks it, or the CPU has no VNNI or AMX int8)")
def test_prepacked_int8_weights_give_the_integer_gemms_bits() -> None:
    """oneDNN's prepacked int8 linear (uint8 codes shifted by 128) and torch._int_mm on the
    plain int8 weight: the same sums, so the same outputs to the bit, projections and head."""
    torch.manual_seed(3)
    w = torch.randn(200, 72) * 0.05
    weight, plain = Int8Weight.quantize(w), Int8Weight.quantize(w, prepack=False)
    assert weight.packed is not None and weight.weight_t is None, "the int8 weight is held once"
    assert weight.shape == plain.shape == (200, 72)
    for rows in (1, 6, 64, 130):
        x = torch.randn(rows, 72) * 4
        assert torch.equal(int8_linear(x, weight, None), int8_linear(x, plain, None))
        assert torch.equal(int8_linear_reference(x, weight, None), int8_linear(x, plain, None))
        # bf16 activations (an int8 model over bfloat16): widened, the same sums, rounded once.
        assert torch.equal(int8_linear(x.bfloat16(), weight, None),
                           int8_linear(x.bfloat16().float(), plain, None).bfloat16())
    table = torch.randn(500, 72)
    head = RescoredInt8Head(Int8Weight.quantize(table), table)
    plain_head = RescoredInt8Head(Int8Weight.quantize(table, prepack=False), table)
    hidden = torch.randn(9, 72)
    assert torch.equal(head.logits(hidden), plain_head.logits(hidden))


def _sums(rows: int = 4, columns: int = 6, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.randint(-1000, 1000, (rows, columns), dtype=torch.int32).to(dtype)


# id -> (a call of the C++ ends with one argument spoiled, the message it must raise)
BAD_QUANTIZATION_CALLS = {
    "quantize x rank": (lambda ops: ops.quantize_rows_two_part(torch.randn(8), False),
                        "quantize_rows_two_part: x has 1 dimensions"),
    "quantize x dtype": (lambda ops: ops.quantize_rows_two_part(torch.randn(2, 8).bfloat16(), True),
                         "quantize_rows_two_part: x is BFloat16"),
    "sums odd rows": (lambda ops: ops.dequantize_two_part(_sums(5), torch.ones(2), torch.ones(6)),
                      "dequantize_two_part: sums has shape"),
    "sums rank": (lambda ops: ops.dequantize_two_part(_sums()[0], torch.ones(2), torch.ones(6)),
                  "dequantize_two_part: sums has shape"),
    "sums dtype": (lambda ops: ops.dequantize_two_part(_sums(dtype=torch.int64), torch.ones(2),
                                                       torch.ones(6)),
                   "dequantize_two_part: sums is Long"),
    "sums not contiguous": (lambda ops: ops.dequantize_two_part(_sums(6, 4).t(), torch.ones(2),
                                                                torch.ones(6)),
                            "dequantize_two_part: sums has strides"),
    "x_scale count": (lambda ops: ops.dequantize_two_part(_sums(), torch.ones(3, 1), torch.ones(6)),
                      "dequantize_two_part: x_scale has 3 values"),
    "x_scale dtype": (lambda ops: ops.dequantize_two_part(_sums(), torch.ones(2, dtype=torch.float64),
                                                          torch.ones(6)),
                      "dequantize_two_part: x_scale is Double"),
    "w_scale count": (lambda ops: ops.dequantize_two_part(_sums(), torch.ones(2), torch.ones(5)),
                      "dequantize_two_part: w_scale has 5 values"),
    "w_scale dtype": (lambda ops: ops.dequantize_two_part(_sums(), torch.ones(2),
                                                          torch.ones(6, dtype=torch.int32)),
                      "dequantize_two_part: w_scale is Int"),
}


@needs_cpu_ops
@pytest.mark.parametrize("case", list(BAD_QUANTIZATION_CALLS))
def test_the_cpp_ends_refuse_bad_arguments_naming_them(case) -> None:
    call, message = BAD_QUANTIZATION_CALLS[case]
    with pytest.raises(RuntimeError, match=message):
        call(torch.ops.spmd_cpu)
