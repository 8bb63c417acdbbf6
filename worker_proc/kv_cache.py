"""Sizing and allocating the paged KV cache of one worker."""
from __future__ import annotations

import psutil
import torch

from runtime.model_config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                    tp_size: int = 1) -> int:
    kv_heads = max(1, config.num_key_value_heads // tp_size)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim * element


def profile_num_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       device: torch.device, *, gpu_memory_utilization: float,
                       cpu_fraction: float, max_useful_blocks: int, tp_size: int = 1) -> int:
    """How many blocks fit in the memory this worker may use (capped at what could ever be used)."""
    per_block = bytes_per_block(config, block_size, dtype, tp_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        # The weights are loaded already, so they are counted in (total - free).
        budget = total * gpu_memory_utilization - (total - free)
    else:
        budget = psutil.virtual_memory().available * cpu_fraction
    return max(0, min(int(budget // per_block), max_useful_blocks))


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, tp_size: int = 1
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (key, value) slot tensors of shape [num_blocks * block_size, kv_heads, head_dim]."""
    kv_heads = max(1, config.num_key_value_heads // tp_size)
    shape = (num_blocks * block_size, kv_heads, config.head_dim)
    # empty, not zeros: untouched pages cost no RAM until a block is first used. The model
    # runner clears each block when a request gets it (attention must never see NaN).
    return [(torch.empty(shape, dtype=dtype, device=device),
             torch.empty(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]
