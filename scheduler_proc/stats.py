"""What the step loop measures about its steps, and the EngineStats reply built from it and the
scheduler's state."""
from __future__ import annotations

import time
from dataclasses import dataclass

from spmd_runtime.protocol.messages import EngineStats, StepResult
from spmd_runtime.scheduler_proc.kv_cache_manager import KVCacheManager
from spmd_runtime.scheduler_proc.scheduler import Scheduler


@dataclass
class StepTimes:
    maintenance_ms: float = 0.0           # scheduler bookkeeping done during steps
    maintenance_hidden_ms: float = 0.0    # of that, within the workers' own time for the step
    # Back-to-back steps: wall time between consecutive results, and the workers' forward time
    # within it; the rest is host time the devices wait through (schedule, IPC, input prep).
    step_wall_ms: float = 0.0
    step_forward_ms: float = 0.0
    # The same steps as rank 0's device saw them: its time on each step, and its idle time
    # between each step and the one launched before it (CUDA: timed by events).
    device_busy_ms: float = 0.0
    device_idle_ms: float = 0.0
    runtime_graph_compilations: int = 0
    num_overlapped_steps: int = 0
    _back_to_back_since: float | None = None

    def add_result(self, result: StepResult, maintenance_ms: float, more_work: bool) -> None:
        """A step's result arrived; `more_work`: the next step can start at once, so the
        interval to its result counts."""
        self.maintenance_ms += maintenance_ms
        self.maintenance_hidden_ms += min(maintenance_ms, result.prepare_ms + result.forward_ms)
        self.runtime_graph_compilations += result.num_compilations
        self.num_overlapped_steps += result.overlapped
        now = time.perf_counter()
        if self._back_to_back_since is not None:
            self.step_wall_ms += (now - self._back_to_back_since) * 1e3
            self.step_forward_ms += result.forward_ms
            if result.idle_ms is not None:
                self.device_busy_ms += result.forward_ms
                self.device_idle_ms += result.idle_ms
        self._back_to_back_since = now if more_work else None

    @property
    def device_idle_fraction(self) -> float:
        """Of back-to-back steps' device time line, the share the device spent idle between
        steps (waiting on schedule, IPC, input preparation, sampling read-back)."""
        total = self.device_busy_ms + self.device_idle_ms
        return self.device_idle_ms / total if total else 0.0


def engine_stats(tag: int, scheduler: Scheduler, times: StepTimes, *, thermal_sensor: str,
                 rejected_frames: int, invalid_requests: int) -> EngineStats:
    kv = scheduler.kv
    counters = scheduler.counters
    planner = scheduler.planner
    thermal = scheduler.thermal
    reading = thermal.reading
    return EngineStats(
        tag=tag, num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
        num_preempted=scheduler.num_preempted, kv_blocks_total=kv.num_blocks,
        kv_blocks_free=kv.num_free_blocks, kv_blocks_in_use=kv.num_blocks - kv.num_free_blocks,
        num_steps=counters.num_steps, num_finished=counters.num_finished,
        num_prompt_tokens=counters.num_prompt_tokens,
        num_generated_tokens=counters.num_generated_tokens,
        num_preemptions=counters.num_preemptions, num_swapped=len(scheduler.swapped),
        num_swaps_out=counters.num_swaps_out, num_swaps_in=counters.num_swaps_in,
        num_soft_resets=counters.num_soft_resets,
        num_worker_restarts=counters.num_worker_restarts,
        cpu_kv_blocks_total=scheduler.cpu_pool.num_blocks,
        cpu_kv_blocks_free=scheduler.cpu_pool.num_free_blocks, scheduler=scheduler.policy,
        bucketing=planner is not None,
        batches_outside_buckets=planner.counters.batches_outside_buckets if planner else 0,
        padding_waste=planner.counters.padding_waste if planner else 0.0,
        runtime_graph_compilations=times.runtime_graph_compilations,
        prefix_caching=kv.enable_caching,
        prefix_cache_queries=kv.counters.queries, prefix_cache_hits=kv.counters.hits,
        prefix_cache_hit_rate=kv.counters.hit_rate, kv_blocks_cached=kv.pool.num_cached_blocks,
        maintenance_ms=times.maintenance_ms, maintenance_hidden_ms=times.maintenance_hidden_ms,
        step_wall_ms=times.step_wall_ms, step_forward_ms=times.step_forward_ms,
        device_idle_fraction=times.device_idle_fraction,
        device_idle_ms=times.device_idle_ms, num_overlapped_steps=times.num_overlapped_steps,
        max_num_seqs=scheduler.max_num_seqs,
        running_cap=scheduler.running_cap if thermal.throttling else scheduler.max_num_seqs,
        thermal_sensor=thermal_sensor,
        max_temp_c=reading.max_temp_c if reading else None,
        hottest_rank=reading.hottest_rank if reading else None,
        rank_temps_c=list(reading.temps_c) if reading else [],
        power_w=reading.power_w if reading else None,
        thermal_throttling=thermal.throttling, thermal_target_c=thermal.policy.target_c,
        thermal_evictions=thermal.thermal_evictions, admin_evictions=thermal.admin_evictions,
        thermal_events=list(thermal.events), rejected_frames=rejected_frames,
        invalid_requests=invalid_requests, **_spec_decode(scheduler), **_window(kv.window_pool))


def _window(pool: KVCacheManager | None) -> dict:
    if pool is None:
        return {}
    return dict(sliding_window=pool.sliding_window, kv_window_blocks_total=pool.num_blocks,
                kv_window_blocks_in_use=pool.num_blocks - pool.num_free_blocks,
                kv_window_blocks_peak=pool.peak_blocks_in_use)


def _spec_decode(scheduler: Scheduler) -> dict:
    speculator = scheduler.speculator
    if speculator is None:
        return {}
    counters = speculator.counters
    return dict(speculative=speculator.method, spec_decode_num_drafts=counters.num_drafts,
                spec_decode_num_draft_tokens=counters.num_draft_tokens,
                spec_decode_num_accepted_tokens=counters.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=list(counters.accepted_per_position))
