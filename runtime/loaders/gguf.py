"""GGUF (llama.cpp) support: config from metadata and dequantised weights under Hugging Face names.
Architectures: llama (Mistral too: llama.cpp converts it as llama), qwen2, qwen3, phi3, gemma2
and gemma3 (its text model).
torch is imported only inside load_gguf_weights so that reading the config stays torch-free.
"""

from __future__ import annotations

import logging
import re
import warnings
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
from spmd_runtime.protocol.model_config import GATE_ACTIVATIONS, ModelConfig, merge_token_ids
from spmd_runtime.runtime.loaders.gguf_file import GGUFFile
from spmd_runtime.runtime.models import model_class

if TYPE_CHECKING:
    import torch

log = logging.getLogger("spmd.loader")
# Float tensor types: loading them is not dequantising.
_PLAIN_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16)
_SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# The family (ModelConfig.architecture) a llama.cpp architecture loads as, where the names differ.
_FAMILIES = MappingProxyType({"gemma3": "gemma3_text"})
_GLOBAL_NAMES = MappingProxyType(
    {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
)
_BLOCK_NAMES = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
# Phi-3's ffn_up holds the stacked gate and up rows (Hugging Face's gate_up_proj); Gemma's four
# norms a layer: ffn_norm is the one before the MLP.
_GEMMA_NORMS = MappingProxyType({"post_attention_norm": "post_attention_layernorm",
                                 "ffn_norm": "pre_feedforward_layernorm",
                                 "post_ffw_norm": "post_feedforward_layernorm"})
_ARCH_BLOCK_NAMES = MappingProxyType({"phi3": MappingProxyType({"ffn_up": "mlp.gate_up_proj"}),
                                      "gemma2": _GEMMA_NORMS, "gemma3_text": _GEMMA_NORMS})
# llama.cpp's converter stores Gemma's norm weights as 1 + weight (the factor they scale by).
_SHIFTED_NORMS = ("gemma2", "gemma3_text")
# Gemma 2's window where a file gives none (llama.cpp's default, src/models/gemma2.cpp).
_GEMMA2_WINDOW = 4096
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(path: str) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (and its tensor list, for tying)."""
    return config_from_reader(GGUFFile(path), path)


def config_from_reader(reader: GGUFFile, path: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (only {_SUPPORTED_ARCHITECTURES})"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp stores Llama-3 rope scaling as precomputed per-frequency factors, whose HF
        # parameters (low/high freq factor, original context) cannot be recovered reliably.
        raise ValueError(
            f"{path}: GGUF rope_freqs (Llama-3 style rope scaling) is not supported; use the HF directory"
        )
    if "rope_factors_long.weight" in tensor_names:
        raise ValueError(f"{path}: GGUF rope_factors_long (Phi-3 longrope scaling) is not supported")

    def key(suffix: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{suffix}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rot_dim = int(key("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise ValueError(
            f"{path}: partial rotary embeddings (rope dim {rot_dim} != head dim {head_dim}) are not supported"
        )

    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    window = int(key("attention.sliding_window", _GEMMA2_WINDOW if arch == "gemma2" else 0))
    family = _FAMILIES.get(arch, arch)
    return ModelConfig(
        vocab_size=_vocab_size(reader, key("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=merge_token_ids(
            *(_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
        ),
        rope_scaling=_rope_scaling(key, path),
        architecture=family,
        # Hugging Face's attention_bias: biases on the output projection too (Qwen2 has q/k/v only).
        attention_bias="blk.0.attn_output.bias" in tensor_names,
        hidden_activation=GATE_ACTIVATIONS.get(family, "silu"),
        **(_gemma_fields(arch, key, head_dim, window, path) if arch in ("gemma2", "gemma3")
           else _every_layer_window(window, int(key("block_count")))),
    )


def _gemma_fields(arch: str, key, head_dim: int, window: int, path: str) -> dict[str, Any]:
    """ModelConfig's Gemma fields as llama.cpp reads them (src/models/gemma2.cpp, gemma3.cpp).
    Soft-caps: the file's, else Gemma 2's 50 (scores) and 30 (logits), Gemma 3's none (0: off).
    No key carries query_pre_attn_scalar: llama.cpp scales queries by head_dim ** -0.5, by
    (hidden / heads) ** -0.5 for the 27B models (as gemma_pytorch), told by their layer count.
    Gemma 3 with a window: every layer but each pattern-th slides (a pattern key, 6 by default,
    or a per-layer list of flags), at rope base rope.freq_base_swa (10000 by default), unscaled.
    Gemma 2's even layers slide (its window: the file's, else 4096), at rope.freq_base, as its
    every layer here."""
    layers, hidden = int(key("block_count")), int(key("embedding_length"))
    is_27b = layers == {"gemma2": 46, "gemma3": 62}[arch]
    fields: dict[str, Any] = {
        "query_pre_attn_scalar": float(hidden // int(key("attention.head_count")) if is_27b
                                       else head_dim),
        "final_logit_softcapping": _cap(key("final_logit_softcapping",
                                            30.0 if arch == "gemma2" else 0.0)),
    }
    if arch == "gemma2":
        swa_theta = key("rope.freq_base_swa")
        if swa_theta is not None and float(swa_theta) != float(key("rope.freq_base", 10000.0)):
            raise ValueError(f"{path}: a Gemma 2 rope base of its own on sliding layers is not supported")
        return {**fields, "attn_logit_softcapping": _cap(key("attn_logit_softcapping", 50.0)),
                "sliding_window": window, "sliding_layers": tuple(range(0, layers, 2))}
    if window <= 0:
        return fields
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):       # a flag per layer
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:                               # every n-th layer full (n = 0: none)
        n = int(pattern)
        sliding = tuple(i for i in range(layers) if n == 0 or i % n < n - 1)
    return {**fields, "sliding_rope_theta": float(key("rope.freq_base_swa", 10000.0)),
            "sliding_layers": sliding, "sliding_window": window}


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _every_layer_window(window: int, layers: int) -> dict[str, Any]:
    """A window the file gives a family other than Gemma's (llama.cpp writes one for Phi-3;
    a Mistral converted with it): on every layer."""
    return {"sliding_window": window, "sliding_layers": tuple(range(layers))} if window > 0 else {}


def _vocab_size(reader: GGUFFile, declared: Any) -> int:
    """The declared vocabulary size, else the tokenizer's, else the embedding table's."""
    if declared is not None:
        return int(declared)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    return next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")


def _rope_scaling(key, path: str) -> dict | None:
    """Hugging Face's rope_scaling dict from the GGUF keys (linear or yarn; none: None)."""
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    if scaling_type == "yarn":
        return {
            "rope_type": "yarn",
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
        }
    raise ValueError(f"{path}: unsupported GGUF rope scaling type {scaling_type!r}")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name of `arch` to its Hugging Face name; ValueError if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = _BLOCK_RE.fullmatch(gguf_name)
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> HF half-split rotary layout).

    Same as transformers' LlamaTensorProcessor._reverse_permute_weights; n_head is the
    number of query heads for Q and of key/value heads for K.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_model(path: str, dtype: torch.dtype, keep_quantized: bool = False
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and weights from one read of the file's directory (gguf_file.GGUFFile)."""
    reader = GGUFFile(path)
    config = config_from_reader(reader, path)
    return config, _weights_from_reader(reader, path, config, dtype, keep_quantized)


def load_gguf_weights(path: str, config: ModelConfig, dtype: torch.dtype,
                      keep_quantized: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file in a CPU state dict with Hugging Face names: dequantised, or
    with `keep_quantized` (--quantization gguf) the projection and embedding weights of the
    block types that have a kernel as GroupQuantWeight (runtime/layers/group_quant.py)."""
    return _weights_from_reader(GGUFFile(path), path, config, dtype, keep_quantized)


def _weights_from_reader(reader: GGUFFile, path: str, config: ModelConfig, dtype: torch.dtype,
                         keep_quantized: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name, checked against the names and shapes that
    config's family reads (as a safetensors checkpoint's are), stacked ones split into parts."""
    from spmd_runtime.runtime.layers.parallel import read_stacked_parts

    family = model_class(config)
    expected, optional = family.checkpoint_shapes(config)
    allowed, stacked = {**expected, **optional}, family.stacked_tensors(config)
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    expanded: dict[str, int] = {}
    for t in reader.tensors:
        name = hf_name(t.name, config.architecture)
        if name not in allowed:
            raise ValueError(f"{path}: tensor {t.name!r} ({name}) does not fit the model config")
        tensor = _loaded_tensor(t, name, config, dtype, keep_quantized, expanded)
        if tuple(tensor.shape) != tuple(allowed[name]):
            raise ValueError(f"{path}: tensor {t.name!r} has shape {tuple(tensor.shape)}, "
                             f"config implies {allowed[name]}")
        seen.add(name)
        out.update(read_stacked_parts(tensor, stacked[name]) if name in stacked else {name: tensor})
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"{path}: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if expanded:
        log.info("%s: %s dequantised to %s (no kernel keeps these types quantized)", path,
                 ", ".join(f"{count} {kind} tensors" for kind, count in sorted(expanded.items())),
                 str(dtype).removeprefix("torch."))
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _loaded_tensor(t, name: str, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool,
                   expanded: dict[str, int]):
    """One GGUF tensor as loaded: kept in its blocks where asked and possible, else dequantised
    (counted in `expanded` by type where it was a quantized type asked to be kept)."""
    import torch
    from spmd_runtime.runtime.layers.group_quant import KEPT_TYPES, from_gguf_blocks

    projection = name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
    if keep_quantized and projection and t.tensor_type in KEPT_TYPES:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weight = from_gguf_blocks(np.asarray(t.data), t.tensor_type, shape, dtype)
        heads = _rotary_heads(t.name, config)
        if heads:
            weight = weight[torch.from_numpy(unpermute_rotary(np.arange(shape[0]), heads))]
        return weight
    if keep_quantized and projection and t.tensor_type not in _PLAIN_TYPES:
        expanded[t.tensor_type.name] = expanded.get(t.tensor_type.name, 0) + 1
    return torch.from_numpy(_dequantised(t, config)).to(dtype)


def _rotary_heads(name: str, config: ModelConfig) -> int:
    """For the llama architecture's Q and K: the head count llama.cpp permuted their rows by;
    0 for every other tensor."""
    if config.architecture == "llama" and ".attn_q." in name:
        return config.num_attention_heads
    if config.architecture == "llama" and ".attn_k." in name:
        return config.num_key_value_heads
    return 0


def _expanded(raw: np.ndarray, tensor_type, in_features: int) -> np.ndarray:
    """A tensor's stored values as floats: a block type through whole-tensor torch operations
    (runtime/layers/gguf_torch.py: gguf's results bit for bit, about 2x faster than its numpy
    code, which loops over rows), other types (plain floats, I-quants) through gguf's own."""
    import torch
    from spmd_runtime.runtime.layers import gguf_torch

    if tensor_type not in gguf_torch.SUPPORTED_TYPES:
        # A plain ndarray view avoids np.memmap's per-slice overhead inside dequantize (~2x).
        return gguf.quants.dequantize(raw, tensor_type)
    rows = raw.reshape(-1, raw.shape[-1])
    # The mapping is read-only and only read here: a tensor view of it, without the warning
    # torch gives for a non-writable array.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(rows)
    return gguf_torch.dequantize(blocks, tensor_type, in_features).numpy()


def _dequantised(t, config: ModelConfig) -> np.ndarray:
    """A tensor as a writable float array in Hugging Face's [out, in] order: for the llama
    architecture with llama.cpp's Q/K row permutation undone (the other architectures keep
    Hugging Face's rotary layout), for Gemma's norms with the converter's + 1 undone."""
    # GGUF lists dims innermost first; HF/numpy order is the reverse ([out, in]).
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    w = _expanded(np.asarray(t.data), t.tensor_type, shape[-1]).reshape(shape)
    if config.architecture in _SHIFTED_NORMS and t.name.endswith("norm.weight"):
        # The model adds the 1 back at load time, as for a Hugging Face checkpoint.
        w = w.astype(np.float32) - 1.0
    elif heads := _rotary_heads(t.name, config):
        w = unpermute_rotary(w, heads)
    if not w.flags.writeable:
        # F32 tensors come back as views of the read-only file mapping.
        w = w.copy()
    return np.ascontiguousarray(w)
