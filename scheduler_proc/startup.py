"""Start-up of the scheduler's state from what the workers report: the buckets every rank
warms up, the KV-cache pools and the scheduler sized to the smallest rank."""
from __future__ import annotations

from spmd_runtime.protocol.buckets import bucketing_enabled, engine_buckets
from spmd_runtime.protocol.config import EngineConfig, step_token_budget
from spmd_runtime.protocol.messages import ModelInfo, WarmupPlan, WorkerLoaded, WorkerReady
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.kv_groups import HybridKVCacheManager
from spmd_runtime.scheduler_proc.scheduler import Scheduler
from spmd_runtime.scheduler_proc.speculation import Speculator
from spmd_runtime.scheduler_proc.thermal import ThermalControl


def derive_warmup_plan(config: EngineConfig, loaded: WorkerLoaded) -> WarmupPlan:
    """The buckets of this engine, from the configuration, this process's environment and the
    first rank to load (its model's context length, device and attention kernel)."""
    buckets = None
    device_type = loaded.device.split(":")[0]
    if bucketing_enabled(config, device_type):
        buckets = engine_buckets(config, loaded.max_model_len, device_type,
                                 loaded.context_from_tensors)
    return WarmupPlan(buckets=buckets)


def kv_cache_manager(config: EngineConfig,
                     ready: dict[int, WorkerReady]
                     ) -> tuple[KVCacheManager | HybridKVCacheManager, int]:
    """The device block pool (two, for a model mixing full and sliding-window layers) and the
    number of CPU swap blocks: the smallest rank's."""
    num_blocks = min(r.num_kv_blocks for r in ready.values())
    num_cpu_blocks = min(r.num_cpu_kv_blocks for r in ready.values())
    window, num_sliding = ready[0].sliding_window or None, ready[0].num_sliding_kv_blocks
    if num_sliding:
        kv = HybridKVCacheManager(
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching),
            KVCacheManager(min(r.num_sliding_kv_blocks for r in ready.values()),
                           config.block_size, config.enable_prefix_caching, window))
    else:
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, window)
    return kv, num_cpu_blocks


def build_scheduler(config: EngineConfig, ready: dict[int, WorkerReady],
                    warmup: WarmupPlan | None,
                    thermal: ThermalControl) -> tuple[Scheduler, ModelInfo]:
    """The scheduler over the group's KV cache, and the model info clients are given."""
    first = ready[0]
    kv, num_cpu_blocks = kv_cache_manager(config, ready)
    # A request holds at most the blocks of its context, or under a window on every layer, those
    # of the window and of a chunk.
    max_model_len = first.max_model_len if kv.sliding_window else min(
        first.max_model_len, kv.num_blocks * config.block_size)
    if config.max_model_len:
        max_model_len = min(max_model_len, config.max_model_len)
    scheduler = Scheduler(
        kv, max_num_batched_tokens=step_token_budget(config, first.device.split(":")[0]),
        max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
        eos_token_ids=first.eos_token_ids, policy=config.scheduler,
        num_cpu_blocks=num_cpu_blocks, admission_watermark=config.kv_admission_watermark,
        buckets=warmup.buckets if warmup is not None else None, thermal=thermal,
        speculator=Speculator.from_config(config))
    info = ModelInfo(tag=0, model=config.model, max_model_len=max_model_len,
                     vocab_size=first.vocab_size, eos_token_ids=first.eos_token_ids,
                     block_size=config.block_size, world_size=config.world_size,
                     served_model_name=config.served_name())
    return scheduler, info
