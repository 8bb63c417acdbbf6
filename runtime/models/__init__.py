"""Model families the workers can run: each architecture (a config.json's model_type, a GGUF
file's general.architecture) names its model class, in a module of this package imported only
when a model is built, so that reading this table (the preflight) stays torch-free."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from spmd_runtime.protocol.model_config import ModelConfig
    from spmd_runtime.runtime.layers.parallel import TensorParallel
    from spmd_runtime.runtime.models.llama import LlamaForCausalLM, ShardSpec


@dataclass(frozen=True)
class Family:
    module: str                     # runtime/models/<module>.py
    class_name: str                 # the model class in it
    hf_classes: tuple[str, ...]     # the config.json `architectures` it reads


# Mistral is Llama with a sliding window (which caps the context, see ModelConfig).
# Gemma is not implemented.
FAMILIES: MappingProxyType[str, Family] = MappingProxyType({
    "llama": Family("llama", "LlamaForCausalLM", ("LlamaForCausalLM",)),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", ("Qwen2ForCausalLM",)),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", ("Qwen3ForCausalLM",)),
    "phi3": Family("phi3", "Phi3ForCausalLM", ("Phi3ForCausalLM",)),
    "mistral": Family("llama", "LlamaForCausalLM", ("MistralForCausalLM",)),
})


def check_architecture(architecture: str, hf_classes: list[str] | tuple[str, ...] = ()) -> None:
    """ValueError naming the supported architectures unless `architecture` (and every class
    a config.json lists under `architectures`) is one this package builds."""
    family = FAMILIES.get(architecture)
    unknown = [name for name in hf_classes if family and name not in family.hf_classes]
    if family is None or unknown:
        what = f"architecture {architecture!r}" + (f" ({', '.join(unknown)})" if unknown else "")
        raise ValueError(f"{what} is not supported: supported architectures are "
                         + ", ".join(f"{name} ({', '.join(f.hf_classes)})"
                                     for name, f in FAMILIES.items()))


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds `config`'s family (ValueError for one this package lacks)."""
    check_architecture(config.architecture)
    family = FAMILIES[config.architecture]
    return getattr(importlib.import_module(f"{__name__}.{family.module}"), family.class_name)


def build_model(config: ModelConfig, dtype: torch.dtype,
                tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """The model of `config`'s family with uninitialised weights (this rank's shard of them)."""
    return model_class(config)(config, dtype, tp)


def shard_spec(config: ModelConfig, tp: TensorParallel) -> ShardSpec:
    """The checkpoint shard spec of `config`'s family for this rank (see llama_shard_spec)."""
    return model_class(config).shard_spec(config, tp)
