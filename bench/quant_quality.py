"""Quality of `--quantization int8` or `gguf` against float32: teacher-forced top-1 agreement and perplexity.

Real English text (by default the design documents in ../shared/seeds/, ~14k tokens) is cut into
windows of --window tokens; each window runs through the model once in float32 and once quantized
(the same loader, model code and attention as the engine's workers). At every position both
models predict the next token from the true prefix (teacher forcing), so an early disagreement
does not snowball: agreement is the share of positions where their top-1 tokens match, and each
model's perplexity is exp(mean negative log-likelihood of the true next token).

    python bench/quant_quality.py                         # all seed documents
    python bench/quant_quality.py --text some.txt --window 512
    python bench/quant_quality.py --dtype bfloat16              # int8 over bf16, against float32
    python bench/quant_quality.py --dtype bfloat16 --quantization none   # bf16 alone
    python bench/quant_quality.py --quantization gguf     # the file's blocks kept, vs dequantised

With `gguf`, every position's products take the integer path (activations held as 16-bit fixed
point per block of 32, integer dot products) that a lone decode row takes, and with float32
activations up to group_quant.f32_integer_rows rows: a window's rows would otherwise go through
the float32 panels (or the GEMM) that longer prompts take (with bfloat16 activations, past
group_quant.bf16_gemm_rows rows: weights rounded to bfloat16, as the dequantized bf16 model
holds them).
`--gguf-products gemm` measures that path instead.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from spmd_runtime.runtime.layers import group_quant
from spmd_runtime.runtime.layers.quantization import QUANTIZATION_METHODS, quantize_linear_weights
from spmd_runtime.runtime.loaders import load_model, resolve_model
from spmd_runtime.runtime.models import build_model
from spmd_runtime.runtime.models.llama import LlamaForCausalLM
from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer
from spmd_runtime.worker_proc.model_loading import keeps_blocks

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"


def build(model: str, quantization: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    source = resolve_model(model)
    config, weights = load_model(source, dtype, keep_quantized=keeps_blocks(quantization, source))
    model = build_model(config, dtype)
    model.load_hf_state_dict(weights)
    if quantization != "gguf":
        quantize_linear_weights(model.eval(), quantization)
    return model.eval()


def read_text(paths: list[Path]) -> str:
    return "\n\n".join(path.read_text() for path in paths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quantization", default="int8", choices=(*QUANTIZATION_METHODS, "gguf"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the compared model's dtype (the reference is float32)")
    parser.add_argument("--text", type=Path, nargs="*",
                        help=f"text files (default: the *.md files of {SEEDS})")
    parser.add_argument("--window", type=int, default=1024, help="tokens per teacher-forced window")
    parser.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens")
    parser.add_argument("--gguf-products", choices=("integer", "gemm"), default="integer",
                        help="gguf: every position's products through the integer dot products "
                        "(decode's few rows) or the float32 GEMM (long prompts)")
    args = parser.parse_args()
    if args.gguf_products == "integer":
        group_quant.DIRECT_ROWS = group_quant.BF16_GEMM_ROWS = 1 << 62
        group_quant.FUSED_INTEGER_ROWS = 1 << 62
        group_quant.K_QUANT_INTEGER_ROWS = dict.fromkeys(group_quant.K_QUANT_TYPES, 1 << 62)
        group_quant.F32_INTEGER_ROWS = dict.fromkeys(group_quant.F32_INTEGER_ROWS, 1 << 62)
        group_quant.F32_K_QUANT_VNNI_INTEGER_ROWS = 1 << 62
    torch.manual_seed(0)
    paths = args.text or sorted(SEEDS.glob("*.md"))
    ids = load_tokenizer(resolve_model(args.model)).encode(read_text(paths))
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    label = f"{args.dtype} {args.quantization}"
    exact = build(args.model, "none")
    quantized = build(args.model, args.quantization, getattr(torch, args.dtype))
    agree = total = 0
    nll = {"float32": 0.0, label: 0.0}
    for start in range(0, len(ids) - 1, args.window):
        window = ids[start:start + args.window + 1]
        if len(window) < 2:
            break
        targets = torch.tensor(window[1:])
        for name, model in (("float32", exact), (label, quantized)):
            logits = model.prompt_logits(window[:-1]).float()
            nll[name] += -torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum().item()
            top1 = logits.argmax(-1)
            if name == "float32":
                reference = top1
            else:
                agree += int((top1 == reference).sum())
        total += len(targets)
    ppl = {name: math.exp(value / total) for name, value in nll.items()}
    change = ppl[label] / ppl["float32"] - 1
    print(f"text: {len(paths)} file(s), {total} scored tokens in windows of {args.window}")
    print(f"top-1 agreement with float32 (teacher-forced): {agree / total:.2%} ({agree}/{total})")
    print(f"perplexity: float32 {ppl['float32']:.3f}, {label} {ppl[label]:.3f} ({change:+.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
