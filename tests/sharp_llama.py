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


SMOLLM2_VOCAB = 49152


def sharp_chat_llama(directory, smollm2_gguf) -> str:
    """A 2-layer sharp Llama with smollm2's vocabulary, and smollm2's tokenizer (and chat
    template) saved with it: text and chat prompts at next to no cost. smollm2_gguf: conftest's
    fixture of that name."""
    from transformers import AutoTokenizer

    sharp_llama(directory, vocab=SMOLLM2_VOCAB)
    gguf_dir, name = smollm2_gguf
    AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=name).save_pretrained(directory)
    return str(directory)


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


# The tiny shape of the family tests (test_model_families, test_gguf): 4 query and 2 key/value
# heads of 16 dimensions, which two ranks split.
FAMILY_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# Chunks of 16 tokens, and a pool of 6 blocks of 16 (no admission watermark): the two longest
# family_prompts share 2 full blocks (the later one finds them in the prefix cache) and need 7
# blocks together at the end of their generation, so one is preempted and resumed.
FAMILY_ENGINE = dict(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=6, kv_admission_watermark=0.0,
                     max_model_len=128, enable_prefix_caching=True)


def ranks_on_one_host(ranks: int) -> dict:
    """Engine options for `ranks` ranks on this host: CPU workers beyond one rank, as a one-GPU
    host cannot give each rank a device of its own (one rank runs wherever auto puts it)."""
    return {"nproc_per_node": ranks, **({"device": "cpu"} if ranks > 1 else {})}


def family_prompts() -> list[list[int]]:
    """Token-id prompts for FAMILY_ENGINE: a short one, and three sharing a 40-token prefix."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (3,), generator=g).tolist(), shared[:20],
            shared + torch.randint(0, VOCAB, (30,), generator=g).tolist(),
            shared[:36] + torch.randint(0, VOCAB, (12,), generator=g).tolist()]


def transformers_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of `prompt` (GREEDY's length, no end token)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=GREEDY.max_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
