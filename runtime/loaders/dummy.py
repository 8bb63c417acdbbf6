"""Random, seeded weights for a ModelConfig (for tests and benchmarks without a checkpoint)."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.models import model_class

_INIT_STD = 0.02  # HF Llama initializer_range: keeps activations and logits finite through many layers


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: a function of the model seed and the tensor's name only,
    so values do not depend on which thread fills which tensor, or on the other tensors."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _random_matrix(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Sample in float32 so a seed gives the same values whatever dtype is asked for.
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, _INIT_STD, generator=gen).to(dtype)


def random_weights(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named state dict of config's family: vectors (norms, biases) are ones, every matrix
    N(0, 0.02); identical for equal seeds in every process. Tensors are drawn in parallel on
    torch's intra-op thread count (sampling with a generator is single-threaded), about 1 s per
    100M parameters and thread."""
    shapes = model_class(config).checkpoint_shapes(config)[0]
    matrices = {name: shape for name, shape in shapes.items() if len(shape) > 1}
    # Largest first, so that the embedding does not start last and run alone.
    order = sorted(matrices, key=lambda name: -torch.Size(matrices[name]).numel())
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        drawn = dict(zip(order, pool.map(
            lambda name: _random_matrix(matrices[name], dtype, tensor_seed(seed, name)), order),
            strict=True))
    return {name: drawn[name] if name in drawn else torch.ones(shape, dtype=dtype)
            for name, shape in shapes.items()}
