"""Hugging Face checkpoint directories: config.json (+ generation_config.json) and *.safetensors.
Config reading is torch-free; safetensors/torch are imported inside load_hf_weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from spmd_runtime.protocol.model_config import ModelConfig, hf_architecture
from spmd_runtime.runtime.models import check_architecture, model_class

if TYPE_CHECKING:
    import torch

# Buffers some older checkpoints saved that are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(path: str) -> ModelConfig:
    """ModelConfig from an HF directory or a config.json path.

    A generation_config.json next to config.json contributes its eos ids.
    """
    p = Path(path)
    config_file = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file not found: {str(config_file)!r}") from None
    try:
        check_architecture(hf_architecture(d), d.get("architectures") or ())
        gen_file = config_file.parent / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return ModelConfig.from_hf_dict(d, gen)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from None


def safetensors_files(directory: str) -> list[Path]:
    """The checkpoint's *.safetensors files (those named by the index when there is one)."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        # The index is authoritative: a directory may also hold e.g. consolidated.safetensors.
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (other weight formats are not supported)")
    return files


def load_hf_weights(directory: str, config: ModelConfig, dtype: torch.dtype,
                    shard_spec=None) -> dict[str, torch.Tensor]:
    """Load the safetensors tensors of an HF checkpoint, cast to dtype, checked against the
    names and shapes config's family implies. With `shard_spec` (name -> (dimension, start,
    count) or None, see runtime.models.shard_spec) only that slice of each tensor is read."""
    from safetensors import safe_open
    from spmd_runtime.runtime.layers.parallel import read_shard, read_stacked_parts

    family = model_class(config)
    expected, optional = family.checkpoint_shapes(config)
    allowed, stacked = {**expected, **optional}, family.stacked_tensors(config)
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for f in safetensors_files(directory):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    # Tied checkpoints sometimes store the shared matrix twice; HF ignores the copy.
                    continue
                if name not in allowed:
                    raise ValueError(f"{f}: unexpected tensor {name!r} for a {config.architecture} model")
                tensor = st.get_slice(name)
                shape = tuple(tensor.get_shape())
                if shape != allowed[name]:
                    raise ValueError(
                        f"{f}: tensor {name!r} has shape {shape}, config implies {allowed[name]}"
                    )
                seen.add(name)
                parts = (read_stacked_parts(tensor, stacked[name], shard_spec) if name in stacked
                         else {name: read_shard(tensor, shard_spec(name) if shard_spec else None)})
                out.update({part: value.to(dtype).contiguous() for part, value in parts.items()})
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"{directory}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return out

