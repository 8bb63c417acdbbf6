"""Model loading entry points: resolve a source, read its config (torch-free), load its weights.
Weights come back as a CPU state dict with Hugging Face Llama parameter names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spmd_runtime.protocol.model_config import ModelConfig, model_preset
from spmd_runtime.protocol.model_source import PRESET_PREFIX, ModelSource, config_source_kind, resolve_model

if TYPE_CHECKING:
    import torch

__all__ = ["ModelSource", "load_model", "load_model_config", "load_weights", "resolve_model"]


def load_model_config(source: ModelSource) -> ModelConfig:
    """Read the model config without importing torch (GGUF metadata, config.json or a preset)."""
    kind = config_source_kind(source)
    if kind == "preset":
        return model_preset(source.path[len(PRESET_PREFIX):])
    if kind == "gguf":
        from spmd_runtime.runtime.loaders.gguf import read_gguf_config

        return read_gguf_config(source.path)
    if kind in ("hf", "json"):
        from spmd_runtime.runtime.loaders.hf_dir import read_hf_config

        return read_hf_config(source.path)
    raise ValueError(f"unknown model source kind {source.kind!r}")


def load_weights(
    source: ModelSource, config: ModelConfig, dtype: torch.dtype, seed: int = 0,
    shard_spec=None,
) -> dict[str, torch.Tensor]:
    """CPU state dict with HF Llama names in dtype; seed only matters for dummy sources.
    `shard_spec` lets formats that can (safetensors) read only a rank's shard of each tensor;
    the others return whole tensors, which the model slices."""
    if source.kind == "gguf":
        from spmd_runtime.runtime.loaders.gguf import load_gguf_weights

        return load_gguf_weights(source.path, config, dtype)
    if source.kind == "hf":
        from spmd_runtime.runtime.loaders.hf_dir import load_hf_weights

        return load_hf_weights(source.path, config, dtype, shard_spec)
    if source.kind == "dummy":
        from spmd_runtime.runtime.loaders.dummy import random_weights

        return random_weights(config, dtype, seed)
    raise ValueError(f"unknown model source kind {source.kind!r}")


def load_model(source: ModelSource, dtype: torch.dtype, seed: int = 0,
               shard_spec_for=None, keep_quantized: bool = False
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and weights together, reading the source once where that matters (GGUF).
    `shard_spec_for(config)` gives the shard spec of load_weights; `keep_quantized` keeps a GGUF
    file's block-quantized weights in their blocks (--quantization gguf)."""
    if source.kind == "gguf":
        from spmd_runtime.runtime.loaders.gguf import load_gguf_model

        return load_gguf_model(source.path, dtype, keep_quantized)
    config = load_model_config(source)
    shard_spec = shard_spec_for(config) if shard_spec_for else None
    return config, load_weights(source, config, dtype, seed, shard_spec)
