"""Random, seeded weights for a ModelConfig (for tests and benchmarks without a checkpoint)."""

from __future__ import annotations

import torch

from runtime.model_config import ModelConfig, weight_shapes

_INIT_STD = 0.02  # HF Llama initializer_range: keeps activations and logits finite through many layers


def random_weights(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named Llama state dict: norms are ones, every matrix N(0, 0.02); identical for equal seeds."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            # Sample in float32 so a seed gives the same values whatever dtype is asked for.
            out[name] = (
                torch.empty(shape, dtype=torch.float32).normal_(0.0, _INIT_STD, generator=gen).to(dtype)
            )
    return out
