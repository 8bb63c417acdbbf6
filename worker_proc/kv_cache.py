"""Sizing and allocating the paged KV cache of one worker."""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import psutil
import torch
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.layers.attention import fresh_prompt_batch
from spmd_runtime.runtime.layers.linear import weight_bytes, weight_parameters
from spmd_runtime.runtime.models.llama import LlamaForCausalLM
from spmd_runtime.worker_proc import host_memory

# The KV cache a CPU worker takes when not told: a laptop-sized bound (see size_kv_cache).
CPU_DEFAULT_KV_BYTES = 2 * 2**30

log = logging.getLogger("spmd.worker")


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                    kv_heads: int | None = None) -> int:
    """A block's bytes over every layer, for `kv_heads` (this rank's; default all of them)."""
    kv_heads = kv_heads or config.num_key_value_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim * element


@dataclass(frozen=True)
class CacheSizing:
    """How one worker's KV cache was sized, for the start-up log."""

    how: str                        # "num_kv_blocks", "kv_cache_memory", "cpu_default", "profiled"
    weights_bytes: int
    bytes_per_block: int
    num_blocks: int
    profile_peak_bytes: int = 0     # activations of the profiling forward pass
    free_bytes: int = 0             # free memory after the weights (and the profile run)
    usable_bytes: int = 0           # gpu_memory_utilization x free_bytes
    capped_at: int = 0              # blocks max_num_seqs x max_model_len can use, if that bit
    graph_reserved_bytes: int = 0   # set aside for captured graphs before sizing the cache
    weights_parameters: int = 0     # parameters the weights hold (for bytes per parameter)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self, block_size: int, utilization: float, max_model_len: int = 0) -> str:
        per_parameter = (f" ({self.weights_bytes / self.weights_parameters:.2f} bytes per "
                         "parameter)" if self.weights_parameters else "")
        parts = [f"weights {_gib(self.weights_bytes)}{per_parameter}"]
        if self.how == "profiled":
            parts += [f"profile-run peak {_gib(self.profile_peak_bytes)}",
                      f"free {_gib(self.free_bytes)} x {utilization:g} = usable "
                      f"{_gib(self.usable_bytes)}"]
            if self.graph_reserved_bytes:
                parts.append(f"{_gib(self.graph_reserved_bytes)} reserved for graphs")
        elif self.how == "kv_cache_memory":
            parts.append("KV cache memory set by --kv-cache-memory")
        elif self.how == "cpu_default":
            parts.append(f"CPU default: {_gib(CPU_DEFAULT_KV_BYTES)}, or a quarter of this "
                         f"worker's share of the available RAM ({_gib(self.free_bytes)}) if "
                         "smaller; --kv-cache-memory sets it")
        else:
            parts.append("KV blocks set by --num-kv-blocks")
        line = (", ".join(parts) + f"; KV cache {_gib(self.kv_cache_bytes)} = {self.num_blocks} "
                f"blocks of {block_size} tokens ({self.bytes_per_block / 1024:.1f} KiB each)")
        if self.capped_at:
            line += " (capped at what max_num_seqs x max_model_len can use)"
        tokens = self.num_blocks * block_size
        line += f"; holds {tokens} tokens"
        if max_model_len:
            line += f", {tokens // max_model_len} requests of max_model_len {max_model_len} at once"
        return line


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def size_kv_cache(config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype,
                  device: torch.device, *, max_useful_blocks: int,
                  local_world_size: int = 1, graphs: bool = False) -> CacheSizing:
    """Blocks for this worker: --num-kv-blocks, else --kv-cache-memory bytes, else on CPU
    CPU_DEFAULT_KV_BYTES or a quarter of this worker's share of the available RAM if smaller (a
    server must not claim most of a machine it shares), else on CUDA what is left of
    gpu_memory_utilization x the memory free after the weights and a profiling forward pass of
    a full token budget, once that pass's activations are set aside, and with `graphs` the
    --graph-reserved-mem share of the usable memory."""
    per_block = bytes_per_block(model.config, config.block_size, dtype, model.shards.num_kv_heads)
    weights, parameters = weight_bytes(model), weight_parameters(model)

    def from_bytes(how: str, budget: int, **details) -> CacheSizing:
        wanted = max(0, budget) // per_block
        return CacheSizing(how, weights, per_block, min(wanted, max_useful_blocks),
                           capped_at=max_useful_blocks if wanted > max_useful_blocks else 0,
                           weights_parameters=parameters, **details)

    if config.num_kv_blocks:
        return CacheSizing("num_kv_blocks", weights, per_block, config.num_kv_blocks,
                           weights_parameters=parameters)
    if config.kv_cache_memory:
        return from_bytes("kv_cache_memory", config.kv_cache_memory)
    if device.type == "cpu":
        free = free_memory(device, local_world_size)
        return from_bytes("cpu_default", min(CPU_DEFAULT_KV_BYTES, free // 4), free_bytes=free)
    peak = profile_forward_peak(model, config.max_num_batched_tokens,
                                min(config.max_num_seqs, config.max_num_batched_tokens),
                                config.block_size, dtype, device)
    free = free_memory(device, local_world_size)
    usable = int(free * config.gpu_memory_utilization)
    graph_reserve = int(usable * config.graph_reserved_mem) if graphs else 0
    return from_bytes("profiled", usable - peak - graph_reserve, profile_peak_bytes=peak,
                      free_bytes=free, usable_bytes=usable, graph_reserved_bytes=graph_reserve)


def free_memory(device: torch.device, local_world_size: int) -> int:
    """Bytes this worker may still take: free device memory, or on CPU its share of the
    available RAM (the workers of a node share it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available // max(1, local_world_size)


@torch.inference_mode()
def profile_forward_peak(model: LlamaForCausalLM, num_tokens: int, num_logit_rows: int,
                         block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Peak activation bytes of one forward pass over `num_tokens` prompt tokens (the largest
    step the scheduler can plan), with logits and sampling for `num_logit_rows` of them."""
    num_blocks = -(-num_tokens // block_size)
    # Zeroed, so touched now: not counted as activations.
    kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, dtype, device,
                                  model.shards.num_kv_heads)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % model.config.max_position_embeddings
    batch = fresh_prompt_batch(num_tokens, model.layer_windows, device)

    def forward() -> None:
        hidden = model(input_ids, positions, kv_caches, batch)
        torch.softmax(model.compute_logits(hidden[-num_logit_rows:]), dim=-1)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _peak_rss_during(forward)


def _release_free_heap() -> None:
    """Give memory malloc holds free (weight loading leaves plenty) back to the OS, so that
    reusing it does not hide the profile run's activations from the RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass            # not glibc: the peak is then a lower bound


def _peak_rss_during(work) -> int:
    """Growth of this process's resident memory at its highest while `work` runs (CPU has no
    allocator statistics, so a thread samples RSS)."""
    _release_free_heap()
    process = psutil.Process()
    before = process.memory_info().rss
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            done.wait(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(0, max(peak, process.memory_info().rss) - before)


def sliding_pool_blocks(config: EngineConfig, model: ModelConfig, num_blocks: int) -> int:
    """For a model mixing full-attention and sliding-window layers, the blocks of its windowed
    layers' pool (0 for any other model), where one pool for every layer would have
    `num_blocks`: each running request holds at most its window's and its chunk's blocks
    there, so past max_num_seqs of those, more would sit idle; their memory goes to the
    full-attention layers' pool instead (split_for_windows)."""
    if not model.sliding_layers or model.all_layers_slide:
        return 0
    bs = config.block_size
    in_use = (config.max_num_seqs * (-(-(model.sliding_window - 1) // bs) + 2)
              + -(-config.max_num_batched_tokens // bs))
    return max(1, min(num_blocks, in_use))


def split_for_windows(model: ModelConfig, sizing: CacheSizing, num_sliding: int,
                      max_useful_blocks: int) -> int:
    """The full-attention layers' blocks once the windowed layers have `num_sliding`: what is
    left of the memory sized for `sizing.num_blocks` on every layer (--num-kv-blocks, as
    given: the full layers' pool)."""
    if sizing.how == "num_kv_blocks":
        return sizing.num_blocks
    layers, windowed = model.num_hidden_layers, len(model.sliding_layers)
    full = (sizing.num_blocks * layers - num_sliding * windowed) // (layers - windowed)
    return min(full, max(max_useful_blocks, sizing.num_blocks))


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, kv_heads: int | None = None,
                      num_sliding_blocks: int = 0, huge_pages: bool = False
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (key, value) slot tensors of shape [num_blocks * block_size, kv_heads, head_dim]
    (the sliding-window layers' with `num_sliding_blocks`, where given, instead); kv_heads:
    this rank's (default all of them); huge_pages: on the CPU, on transparent huge pages where
    the kernel gives them (worker_proc/host_memory.py)."""
    kv_heads = kv_heads or config.num_key_value_heads

    def shape(layer: int) -> tuple[int, int, int]:
        rows = num_sliding_blocks if num_sliding_blocks and layer in config.sliding_layers \
            else num_blocks
        return rows * block_size, kv_heads, config.head_dim

    # Zeroed, like vLLM's: attention reads whole blocks and masks the slots not written yet,
    # and a masked slot still multiplies its value by zero, so no slot may ever hold NaN or
    # inf (what uninitialised memory can). Every page is also touched now: the resident memory
    # is the whole pool from the start, rather than creeping up as blocks are first used.
    if device.type == "cpu":
        slots = host_memory.zeroed([shape(layer // 2) for layer in
                                    range(2 * config.num_hidden_layers)], dtype, huge_pages)
        return list(zip(slots[0::2], slots[1::2], strict=True))
    return [(torch.zeros(shape(layer), dtype=dtype, device=device),
             torch.zeros(shape(layer), dtype=dtype, device=device))
            for layer in range(config.num_hidden_layers)]


def log_huge_pages(caches: list[tuple[torch.Tensor, torch.Tensor]], asked: bool,
                   rank: int) -> None:
    """Whether a CPU KV cache lies on huge pages, and if not, why."""
    mode = host_memory.huge_pages_mode()
    if not asked:
        log.info("rank %d KV cache on 4 KiB pages (--no-kv-cache-huge-pages)", rank)
    elif mode not in ("always", "madvise"):
        log.info("rank %d KV cache on 4 KiB pages: transparent huge pages are %s here (%s)",
                 rank, mode, host_memory.THP_SETTING)
    else:
        tensors = [t for pair in caches for t in pair]
        total = sum(t.numel() * t.element_size() for t in tensors)
        log.info("rank %d KV cache on transparent huge pages: %.2f of %.2f GiB", rank,
                 host_memory.huge_page_bytes(tensors) / 2**30, total / 2**30)


def allocate_pools(config: EngineConfig, model: ModelConfig, sizing: CacheSizing,
                   max_useful_blocks: int, dtype: torch.dtype, device: torch.device,
                   kv_heads: int, rank: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                     int, int, int]:
    """The KV cache `sizing` allows, with one scratch block more per pool than the scheduler
    knows of (the last: padding writes to it): (caches, blocks of the full-attention pool,
    blocks of the sliding-window layers' pool (0: one pool), CPU swap blocks)."""
    num_blocks = sizing.num_blocks
    num_sliding = sliding_pool_blocks(config, model, num_blocks)
    if num_sliding:
        num_blocks = split_for_windows(model, sizing, num_sliding, max_useful_blocks)
        log.info("rank %d KV cache split: %d blocks for the %d full-attention layers, %d for "
                 "the %d sliding-window layers (window %d)", rank, num_blocks,
                 model.num_hidden_layers - len(model.sliding_layers), num_sliding,
                 len(model.sliding_layers), model.sliding_window)
    kv_caches = allocate_kv_cache(model, num_blocks + 1, config.block_size, dtype, device,
                                  kv_heads, num_sliding + 1 if num_sliding else 0,
                                  huge_pages=config.kv_cache_huge_pages)
    if device.type == "cpu":
        log_huge_pages(kv_caches, config.kv_cache_huge_pages, rank)
    # A CPU block holds one block of context in every layer, whichever pool it came from.
    num_cpu_blocks = config.kv_swap_memory // sizing.bytes_per_block
    return kv_caches, num_blocks, num_sliding, num_cpu_blocks
