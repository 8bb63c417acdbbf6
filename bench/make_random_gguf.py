"""A real-size model without downloads: a GGUF file of random weights in a released model's shape.

    python bench/make_random_gguf.py --shape llama-3.1-8b --type Q4_K_M OUT.gguf
    python bench/make_random_gguf.py --shape llama-3.2-3b --type Q8_0 OUT.gguf
    python bench/make_random_gguf.py --shape qwen2.5-7b --type Q4_K_M OUT.gguf

The quantized tensors are written directly as random blocks (any bytes are valid codes and
scales; the float16 scales are set to a real file's size), in the types llama.cpp's preset
gives each tensor (Q4_K_M: Q6_K for the output and for the value and down projections of the
first and last eighth of the layers and every third between, Q4_K elsewhere, as
llama-quantize's rule), so the file has the layout and size of the preset without llama.cpp.
The weights are noise: the file is for memory and speed, not for text. Norms are float32 ones;
there is no tokenizer (prompts are token ids). F16 writes float16 weights of the same shapes
(the input llama-quantize takes).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    tied: bool = False
    qkv_bias: bool = False


SHAPES = {
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, 500000.0),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, 500000.0, tied=True),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 1000000.0, qkv_bias=True),
    # For tests: every width a multiple of 256, as the K-quants need.
    "tiny": Shape("llama", 256, 512, 2, 4, 2, 1024, 10000.0),
}
# Bytes per super-block of 256 weights and where its float16 scales lie.
_K_LAYOUT = {GGML.Q4_K: (144, (0, 2)), GGML.Q5_K: (176, (0, 2)), GGML.Q6_K: (210, (208,))}
PRESETS = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q4_K_M")


def tensor_type(preset: str, name: str, layer: int | None, layers: int) -> GGML:
    """The type a preset gives a tensor (Q4_K_M by llama-quantize's rule for it)."""
    if preset != "Q4_K_M":
        return GGML[preset]
    more_bits = layer is not None and (layer < layers // 8 or layer >= 7 * layers // 8
                                       or (layer - layers // 8) % 3 == 2)
    if name == "output" or (name in ("attn_v", "ffn_down") and more_bits):
        return GGML.Q6_K
    return GGML.Q4_K


def random_tensor(rng: np.random.Generator, kind: GGML, rows: int, columns: int) -> np.ndarray:
    """Random weights of `kind`: float16 noise, or random blocks with float16 scales ~1e-3."""
    if kind == GGML.F16:
        return (rng.standard_normal((rows, columns), np.float32) * 0.02).astype(np.float16)
    if kind in _K_LAYOUT:
        size, halves = _K_LAYOUT[kind]
        blocks = rng.integers(0, 256, (rows, columns // 256, size), dtype=np.uint8)
        for offset in halves:
            scale = rng.uniform(5e-4, 2e-3, blocks.shape[:2]).astype(np.float16)
            blocks[..., offset:offset + 2] = scale[..., None].view(np.uint8)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, columns), np.float32) * 0.02, kind)


def add_vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """A SentencePiece-style vocabulary of `size` tokens (its 256 byte tokens, then fillers; BOS
    1, EOS the last): what llama.cpp needs to load the file; the engines get token ids."""
    tokens = ["<unk>", "<s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens) - 1)] + ["</s>"]
    types = [2, 3] + [6] * 256 + [1] * (size - 259) + [3]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * size)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(size - 1)


def write(path: str, shape: Shape, preset: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, shape.arch)
    head_dim = shape.hidden // shape.heads
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(shape.vocab)
    add_vocabulary(writer, shape.vocab)

    def add(name: str, rows: int, columns: int, layer: int | None = None) -> None:
        kind = tensor_type(preset, name.split(".")[-2], layer, shape.layers)
        data = random_tensor(rng, kind, rows, columns)
        writer.add_tensor(name, data, raw_dtype=None if kind == GGML.F16 else kind)

    add("token_embd.weight", shape.vocab, shape.hidden)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    if not shape.tied:
        add("output.weight", shape.vocab, shape.hidden)
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        block = f"blk.{i}"
        for name, rows, columns in (("attn_q", shape.hidden, shape.hidden),
                                    ("attn_k", kv, shape.hidden), ("attn_v", kv, shape.hidden),
                                    ("attn_output", shape.hidden, shape.hidden),
                                    ("ffn_gate", shape.intermediate, shape.hidden),
                                    ("ffn_up", shape.intermediate, shape.hidden),
                                    ("ffn_down", shape.hidden, shape.intermediate)):
            add(f"{block}.{name}.weight", rows, columns, i)
        if shape.qkv_bias:
            for name, rows in (("attn_q", shape.hidden), ("attn_k", kv), ("attn_v", kv)):
                writer.add_tensor(f"{block}.{name}.bias", np.zeros(rows, np.float32))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"{block}.{name}.weight", np.ones(shape.hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    parser.add_argument("--type", choices=PRESETS, default="Q4_K_M")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("out")
    args = parser.parse_args(argv)
    write(args.out, SHAPES[args.shape], args.type, args.seed)
    print(f"wrote {args.out}: {args.shape} in {args.type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
