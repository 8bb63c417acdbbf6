"""Model hyper-parameters shared by every process (torch-free).
Built from a Hugging Face config.json dict or from GGUF metadata by runtime.loaders, or taken
from the built-in presets (MODEL_PRESETS) that `dummy:<preset>` models use.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

# Hugging Face LlamaConfig defaults, used when a config.json omits a field.
_HF_DEFAULT_RMS_NORM_EPS = 1e-6
_HF_DEFAULT_ROPE_THETA = 10000.0
_HF_DEFAULT_MAX_POSITIONS = 2048
# Gemma3TextConfig's rope base of the sliding-window layers, where a config.json omits it.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    rope_scaling: dict | None = None  # HF-style dict as the source gives it, or None
    # The family (a config.json's model_type, a GGUF general.architecture): runtime.models
    # builds its model class. Family-specific: whether the attention projections carry biases.
    architecture: str = "llama"
    attention_bias: bool = False
    # Gemma 2: the MLP's gate activation, the attention scale's denominator (None: head_dim)
    # and the tanh soft-caps of attention scores and final logits (None: no cap).
    hidden_activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the rope base of its sliding-window layers (None: rope_theta on every layer);
    # rope_scaling applies to the others only.
    sliding_rope_theta: float | None = None
    # Sliding-window attention: these layers attend only to the last `sliding_window` tokens
    # (the query's own included), the others to the whole context.
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        # Accept lists (e.g. after a JSON round trip of dataclasses.asdict) so equality holds.
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        if self.sliding_layers and not (self.sliding_window or 0) > 0:
            raise ValueError(f"sliding_layers {self.sliding_layers} need a sliding_window >= 1, "
                             f"got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_dict(cls, d: dict, generation_config: dict | None = None) -> ModelConfig:
        """Build from a config.json dict; generation_config (generation_config.json) adds eos ids."""
        architecture = hf_architecture(d)
        act = d.get("hidden_activation") or d.get("hidden_act", "silu")
        family_act = GATE_ACTIVATIONS.get(architecture, "silu")
        if act != family_act:
            raise ValueError(f"unsupported hidden_act {act!r}: {architecture} models are built "
                             f"with {family_act} MLPs")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        gen = generation_config or {}

        rope_theta, rope_scaling, sliding_rope_theta = _rope(d)
        bos = d.get("bos_token_id")
        if bos is None:
            bos = gen.get("bos_token_id")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", _HF_DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            max_position_embeddings=int(d.get("max_position_embeddings",
                                              _HF_DEFAULT_MAX_POSITIONS)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=merge_token_ids(d.get("eos_token_id"), gen.get("eos_token_id")),
            rope_scaling=rope_scaling,
            architecture=architecture,
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_activation=act,
            query_pre_attn_scalar=_optional_float(d.get("query_pre_attn_scalar")),
            attn_logit_softcapping=_optional_float(d.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(d.get("final_logit_softcapping")),
            sliding_rope_theta=sliding_rope_theta,
            **_sliding_window(d),
        )

    def window_of(self, layer: int) -> int | None:
        """The tokens layer `layer` attends to (None: the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def all_layers_slide(self) -> bool:
        """Every layer has the window: blocks that leave it can be freed for the whole model."""
        return len(self.sliding_layers) == self.num_hidden_layers

    def to_hf_dict(self) -> dict:
        """A config.json dict (transformers 4 layout, which 5 reads too); inverse of from_hf_dict."""
        return {
            "model_type": self.architecture,
            "architectures": [f"{self.architecture.removesuffix('_text').capitalize()}ForCausalLM"],
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_activation,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            **{name: value for name, value in (
                ("query_pre_attn_scalar", self.query_pre_attn_scalar),
                ("attn_logit_softcapping", self.attn_logit_softcapping),
                ("final_logit_softcapping", self.final_logit_softcapping),
                ("rope_local_base_freq", self.sliding_rope_theta)) if value is not None},
            **({"layer_types": ["sliding_attention" if i in self.sliding_layers
                                else "full_attention" for i in range(self.num_hidden_layers)],
                "sliding_window": self.sliding_window} if self.sliding_layers else {}),
        }


# The MLP gate activation each family computes (silu where not listed): a config.json asking
# another is refused rather than silently computed with the family's.
GATE_ACTIVATIONS = MappingProxyType({"gemma2": "gelu_pytorch_tanh",
                                       "gemma3_text": "gelu_pytorch_tanh"})


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# rope_scaling types RotaryEmbedding implements (None and "default": no scaling).
SUPPORTED_ROPE_TYPES = (None, "default", "linear", "llama3")


def _rope(d: dict) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope_scaling, the sliding-window layers' rope base or None) of a config.json.
    transformers >= 5 writes theta and scaling inside rope_parameters, per layer type where the
    types differ (Gemma 3); 4 wrote them at the top, Gemma 3's local base as
    rope_local_base_freq."""
    rope_params = d.get("rope_parameters") or {}
    sliding = rope_params.get("sliding_attention")
    rope_params = rope_params.get("full_attention", rope_params)
    rope_theta = d.get("rope_theta", rope_params.get("rope_theta", _HF_DEFAULT_ROPE_THETA))
    rope_scaling = d.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if float(rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not implemented "
                         f"(supported: none, {', '.join(t for t in SUPPORTED_ROPE_TYPES if t)})")
    if sliding and sliding.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling of the sliding-window layers ({sliding['rope_type']!r}) "
                         "is not implemented")
    local = d.get("rope_local_base_freq", (sliding or {}).get("rope_theta"))
    if local is None and hf_architecture(d) == "gemma3_text":
        local = _GEMMA3_LOCAL_ROPE_THETA
    return float(rope_theta), dict(rope_scaling) if rope_scaling else None, _optional_float(local)


def _sliding_window(d: dict) -> dict[str, Any]:
    """ModelConfig's sliding_window and sliding_layers of a config.json: the layers its
    layer_types name sliding_attention; without layer_types, Qwen2/Qwen3's use_sliding_window
    (the layers from max_window_layers on), Gemma 2's every other layer (the even ones),
    Gemma 3's sliding_window_pattern (every layer but each pattern-th, 6 by default), and any
    other family's every layer (Mistral, Phi-3)."""
    window, layers = d.get("sliding_window"), int(d["num_hidden_layers"])
    architecture = hf_architecture(d)
    if d.get("layer_types"):
        sliding = tuple(i for i, kind in enumerate(d["layer_types"]) if kind == "sliding_attention")
    elif "use_sliding_window" in d:
        sliding = tuple(range(int(d.get("max_window_layers") or 0), layers)) \
            if d["use_sliding_window"] else ()
    elif architecture == "gemma2":
        sliding = tuple(range(0, layers, 2))
    elif architecture == "gemma3_text":
        pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern)
    else:
        sliding = tuple(range(layers))
    if not sliding:
        return {}
    if not window:
        if d.get("layer_types"):
            raise ValueError("layer_types names sliding_attention layers but sliding_window is "
                             "not set")
        return {}
    return {"sliding_window": int(window), "sliding_layers": sliding}


def hf_architecture(d: dict) -> str:
    """The family of a config.json: its model_type, else its architectures' class name
    ("Qwen2ForCausalLM" -> "qwen2"), else "llama"."""
    if d.get("model_type"):
        return str(d["model_type"])
    classes = d.get("architectures") or ["LlamaForCausalLM"]
    return str(classes[0]).removesuffix("ForCausalLM").lower()


def merge_token_ids(*values: Any) -> tuple[int, ...]:
    """Flatten ints / lists / None into a de-duplicated tuple, keeping first-seen order."""
    out: list[int] = []
    for v in values:
        if v is None:
            continue
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if i is not None and int(i) not in out:
                out.append(int(i))
    return tuple(out)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama parameter names and shapes implied by config (no biases)."""
    h, hd = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def optional_bias_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Attention bias names and shapes a source may carry in addition to weight_shapes."""
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        shapes.update(
            {
                p + "q_proj.bias": (q,),
                p + "k_proj.bias": (kv,),
                p + "v_proj.bias": (kv,),
                p + "o_proj.bias": (h,),
            }
        )
    return shapes


def _tied_llama(**fields: Any) -> ModelConfig:
    """A Llama with tied embeddings, rms_norm_eps 1e-5 and head_dim = hidden_size / heads."""
    return ModelConfig(tie_word_embeddings=True, rms_norm_eps=1e-5,
                       head_dim=fields["hidden_size"] // fields["num_attention_heads"], **fields)


def _llama3_rope(factor: float, original_max_position_embeddings: int) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original_max_position_embeddings}


# Built-in model shapes, for `dummy:<name>` (random weights; no checkpoint or tokenizer needed).
MODEL_PRESETS: MappingProxyType[str, ModelConfig] = MappingProxyType({
    # meta-llama/Llama-3.2-1B's config.json.
    "llama-3.2-1b": _tied_llama(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001,),
        rope_scaling=_llama3_rope(32.0, 8192)),
    # HuggingFaceTB/SmolLM2-135M: the shape of the embedded 'smollm2' model.
    "smollm2-135m": _tied_llama(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
    # A toy Llama-3-style shape (tied embeddings, llama3 rope scaling) for fast tests.
    "tiny-llama": _tied_llama(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
        rope_scaling=_llama3_rope(8.0, 512)),
})


def model_preset(name: str) -> ModelConfig:
    """A copy of a built-in preset (its rope_scaling dict is the caller's own); ValueError if unknown."""
    try:
        preset = MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}: one of {', '.join(MODEL_PRESETS)}") from None
    return dataclasses.replace(
        preset, rope_scaling=dict(preset.rope_scaling) if preset.rope_scaling else None)
