"""The engine's stats reply: a wire message that prints as a short report grouped by domain."""
from __future__ import annotations

from typing import Any

import msgspec


class ThermalEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A throttle start or stop, or an eviction, as the scheduler saw it (newest last in stats)."""

    step: int                   # the step planned next when it happened
    kind: str                   # throttle_start, throttle_stop, thermal_evict or admin_evict
    max_temp_c: float | None
    cap: int                    # the cap on running requests (after an eviction: the new one)
    running: int                # running requests after the event
    request_ids: list[int] = []


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                  tag="stats_reply", forbid_unknown_fields=True):
    """What the scheduler knows about itself. `str(stats)` is a report of a few lines;
    `as_dict()` every field by name."""

    tag: int
    num_waiting: int
    num_running: int
    num_preempted: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_in_use: int
    num_steps: int
    num_finished: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int               # swaps out + soft resets
    num_swapped: int                   # requests whose KV blocks wait in the CPU pool now
    num_swaps_out: int
    num_swaps_in: int
    num_soft_resets: int               # preemptions that dropped the KV cache (recompute)
    cpu_kv_blocks_total: int
    cpu_kv_blocks_free: int
    scheduler: str
    bucketing: bool
    batches_outside_buckets: int       # bucketed engines: batches larger than every bucket
    padding_waste: float               # padded tokens / computed tokens of bucketed steps
    runtime_graph_compilations: int    # compilations or captures after warmup
    prefix_caching: bool
    prefix_cache_queries: int          # prompt tokens looked up at admission
    prefix_cache_hits: int             # of those, tokens served from the cache
    prefix_cache_hit_rate: float
    kv_blocks_cached: int              # blocks holding a hashed, reusable prefix
    maintenance_ms: float              # scheduler bookkeeping done during steps, in total
    maintenance_hidden_ms: float       # of that, overlapped with the workers' forward passes
    step_wall_ms: float                # back-to-back steps: wall time from result to result
    step_forward_ms: float             # of that, rank 0's step times (CUDA: events; CPU: forward + sampling)
    device_idle_fraction: float        # idle / (busy + idle) of rank 0's device over those steps
    max_num_seqs: int                  # as configured, or as last set by an admin call
    running_cap: int                   # most requests allowed to run now (thermal cap included)
    thermal_sensor: str                # rank 0's sensor kind: nvml, psutil, file, none
    max_temp_c: float | None           # hottest device of the group at the last reading
    hottest_rank: int | None
    rank_temps_c: list[float | None]   # every rank's last reading (None: no reading)
    power_w: float | None              # the group's power draw, where the sensors report it
    thermal_throttling: bool
    thermal_target_c: float
    thermal_evictions: int             # requests taken off the batch by the thermal policy
    admin_evictions: int               # requests taken off the batch by admin calls
    thermal_events: list[ThermalEvent]
    num_worker_restarts: int           # times the worker group was replaced after a death
    rejected_frames: int               # frames refused before decoding: undecodable or too large
    invalid_requests: int              # decoded requests refused: bad values, unknown ids, admin
    device_idle_ms: float = 0.0        # rank 0's idle time between back-to-back steps (CUDA: event-timed)
    num_overlapped_steps: int = 0      # steps workers launched behind an unfinished one
    # Speculative decoding (vLLM's spec_decode counters): "" when off, else its method.
    speculative: str = ""
    spec_decode_num_drafts: int = 0            # steps x requests that verified proposals
    spec_decode_num_draft_tokens: int = 0      # tokens proposed
    spec_decode_num_accepted_tokens: int = 0   # of those, accepted
    spec_decode_num_accepted_tokens_per_pos: list[int] = []   # accepted at draft position 0, 1 ...
    # Sliding-window attention (0: none): the window, and the blocks of the windowed layers'
    # pool (the whole cache where every layer has the window), in use now and at most.
    sliding_window: int = 0
    kv_window_blocks_total: int = 0
    kv_window_blocks_in_use: int = 0
    kv_window_blocks_peak: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted proposals per proposal."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0

    @property
    def spec_decode_tokens_per_draft(self) -> float:
        """Tokens a verifying request gained per step: the proposals it accepted, and one."""
        drafts = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0

    @property
    def device_busy_ms(self) -> float:
        """Rank 0's device time on back-to-back steps: the same figure as step_forward_ms."""
        return self.step_forward_ms

    def as_dict(self) -> dict[str, Any]:
        """Every figure by its field name (the reply's tag left out), events as dicts."""
        values = {name: getattr(self, name) for name in self.__struct_fields__ if name != "tag"}
        values["rank_temps_c"] = list(self.rank_temps_c)
        values["thermal_events"] = [msgspec.structs.asdict(e) for e in self.thermal_events]
        return values

    def __str__(self) -> str:
        return "\n".join(f"{label + ':':<14}{text}" for label, text in self._report())

    def _report(self) -> list[tuple[str, str]]:
        rows = [
            ("requests", f"{self.num_running} running (cap {self.running_cap}, max_num_seqs "
                         f"{self.max_num_seqs}), {self.num_waiting} waiting, {self.num_swapped} "
                         f"swapped, {self.num_preempted} preempted; {self.num_finished:,} finished"),
            ("tokens", f"{self.num_prompt_tokens:,} prompt, {self.num_generated_tokens:,} generated"),
            ("KV cache", f"{self.kv_blocks_in_use} of {self.kv_blocks_total} blocks in use, "
                         f"{self.kv_blocks_free} free, {self.kv_blocks_cached} cached; " + (
                             f"swap space {self.cpu_kv_blocks_free} of {self.cpu_kv_blocks_total} "
                             "blocks free" if self.cpu_kv_blocks_total else "no swap space")),
            *([("window KV", f"{self.kv_window_blocks_in_use} of {self.kv_window_blocks_total} "
                             f"blocks in use (at most {self.kv_window_blocks_peak}), window "
                             f"{self.sliding_window} tokens")] if self.sliding_window else []),
            ("prefix cache", _prefix_cache(self)),
            ("preemptions", f"{self.num_preemptions} ({self.num_swaps_out} swaps out, "
                            f"{self.num_swaps_in} swaps in, {self.num_soft_resets} soft resets)"),
            ("steps", f"{self.num_steps:,} ({self.num_overlapped_steps:,} overlapped); back to "
                      f"back: {_ms(self.step_wall_ms)} wall, {_ms(self.step_forward_ms)} forward, "
                      f"device idle {self.device_idle_fraction:.1%} ({_ms(self.device_idle_ms)})"),
            ("scheduler", f"{self.scheduler}; bookkeeping {_ms(self.maintenance_ms)}, "
                          f"{_ms(self.maintenance_hidden_ms)} of it hidden behind forward passes"),
            ("buckets", f"padding waste {self.padding_waste:.1%}, {self.batches_outside_buckets} "
                        f"batches outside every bucket, {self.runtime_graph_compilations} "
                        "compilations after warmup" if self.bucketing else "off"),
            ("speculative", _speculative(self)),
            ("thermal", _thermal(self)),
            ("faults", f"{self.num_worker_restarts} worker restarts, {self.rejected_frames} "
                       f"rejected frames, {self.invalid_requests} invalid requests"),
        ]
        if self.thermal_events:
            last = self.thermal_events[-1]
            rows.append(("last event", f"{last.kind} at step {last.step} ({_temp(last.max_temp_c)}, "
                                       f"cap {last.cap}, {last.running} running)"))
        return rows


def _ms(value: float) -> str:
    return f"{value:,.1f} ms"


def _temp(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} C"


def _prefix_cache(stats: EngineStats) -> str:
    if not stats.prefix_caching:
        return "off"
    return (f"hit rate {stats.prefix_cache_hit_rate:.1%} ({stats.prefix_cache_hits:,} of "
            f"{stats.prefix_cache_queries:,} prompt tokens looked up)")


def _speculative(stats: EngineStats) -> str:
    if not stats.speculative:
        return "off"
    return (f"{stats.speculative}: {stats.spec_decode_num_accepted_tokens:,} of "
            f"{stats.spec_decode_num_draft_tokens:,} proposed tokens accepted "
            f"({stats.spec_decode_acceptance_rate:.1%}), {stats.spec_decode_tokens_per_draft:.2f} "
            f"tokens per verifying step ({stats.spec_decode_num_drafts:,} of them)")


def _thermal(stats: EngineStats) -> str:
    text = f"sensor {stats.thermal_sensor}"
    if stats.max_temp_c is not None:
        text += f", hottest {_temp(stats.max_temp_c)} on rank {stats.hottest_rank}"
        if len(stats.rank_temps_c) > 1:
            text += f" (ranks: {', '.join(_temp(t) for t in stats.rank_temps_c)})"
    if stats.power_w is not None:
        text += f", {stats.power_w:,.0f} W"
    state = "throttling" if stats.thermal_throttling else "not throttling"
    return (f"{text}; target {_temp(stats.thermal_target_c)}, {state}; evictions: "
            f"{stats.thermal_evictions} thermal, {stats.admin_evictions} admin")
