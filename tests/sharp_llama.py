"""Tiny random Llamas (and models of the other families) whose logits are far from ties
(weights scaled up), saved as Hugging Face directories: engine variants that compute the same
thing must pick the same greedy tokens."""
from __future__ import annotations

import torch
from spmd_runtime.runtime import SamplingParams

VOCAB = 250            # not a multiple of the TP sizes: the last vocabulary shard is padded
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SMALL = dict(num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=128)


def sharp_llama(directory, heads: int = 4, kv_heads: int = 2, vocab: int = VOCAB,
                hidden: int = 64, intermediate: int = 128):
    """(directory as a string, the transformers model) of a 2-layer Llama with these heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate, max_position_embeddings=256)
    return save_sharp(directory, lambda: LlamaForCausalLM(config))


def save_sharp(directory, build, norm_center: float = 1.0):
    """Build a transformers model with `build()` (seeded), scale its weights up (norms near
    `norm_center`, every other weight N(0, 0.25)) and save it: (directory as a string, the
    model). Gemma's norms scale by 1 + weight: a center of 0 keeps them near one."""
    torch.manual_seed(0)
    model = build().float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(norm_center + 0.2 * torch.randn_like(param) if "norm" in name
                        else 0.25 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory), model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 30, 70)]
