"""Prometheus metrics of the HTTP front: its own latency histograms and the engine's stats.

Engine figures are read with one stats call per scrape and exposed through a collector, so
counters kept by the scheduler stay counters here without being mirrored.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from spmd_runtime.protocol.messages import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineStatsCollector:
    """Yields the last EngineStats snapshot as Prometheus families (nothing before the first)."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def describe(self) -> list:
        return []   # families depend on the snapshot (thermal ones only with a reading)

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        kv_usage = stats.kv_blocks_in_use / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        gauges = [
            ("spmd_num_requests_running", "requests in the running batch", stats.num_running),
            ("spmd_num_requests_waiting", "requests waiting to be admitted", stats.num_waiting),
            ("spmd_num_requests_swapped", "preempted requests whose KV blocks wait in the CPU pool",
             stats.num_swapped),
            ("spmd_kv_cache_usage_ratio", "share of the device KV blocks in use", kv_usage),
            ("spmd_kv_blocks_total", "device KV-cache blocks", stats.kv_blocks_total),
            ("spmd_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / looked up",
             stats.prefix_cache_hit_rate),
            ("spmd_max_num_seqs", "configured cap on running requests (or as set by admin)",
             stats.max_num_seqs),
            ("spmd_running_cap", "running requests allowed now, thermal cap included",
             stats.running_cap),
            ("spmd_thermal_throttling", "1 while the thermal policy shrinks the batch",
             int(stats.thermal_throttling)),
            ("spmd_thermal_target_celsius", "hottest-device temperature the policy aims under",
             stats.thermal_target_c),
        ]
        if stats.max_temp_c is not None:
            gauges.append(("spmd_max_temperature_celsius", "hottest device of the group",
                           stats.max_temp_c))
        if stats.power_w is not None:
            gauges.append(("spmd_power_watts", "the group's power draw", stats.power_w))
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = [
            ("spmd_prompt_tokens", "prompt tokens admitted", stats.num_prompt_tokens),
            ("spmd_generation_tokens", "tokens generated", stats.num_generated_tokens),
            ("spmd_num_preemptions", "preemptions (swaps out and soft resets)",
             stats.num_preemptions),
            ("spmd_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
             stats.prefix_cache_queries),
            ("spmd_prefix_cache_hits", "prompt tokens served from the prefix cache",
             stats.prefix_cache_hits),
            ("spmd_engine_finished_requests", "requests finished by the engine", stats.num_finished),
            ("spmd_thermal_evictions", "requests taken off the batch by the thermal policy",
             stats.thermal_evictions),
            ("spmd_admin_evictions", "requests taken off the batch by admin calls",
             stats.admin_evictions),
        ]
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        if any(t is not None for t in stats.rank_temps_c):
            family = GaugeMetricFamily("spmd_rank_temperature_celsius",
                                       "each rank's last temperature reading", labels=["rank"])
            for rank, temp in enumerate(stats.rank_temps_c):
                if temp is not None:
                    family.add_metric([str(rank)], temp)
            yield family


class ServingMetrics:
    """Everything /metrics shows, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "spmd_time_to_first_token_seconds", "from the HTTP request to the first output token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "spmd_inter_token_latency_seconds", "between consecutive output tokens of a choice",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "spmd_e2e_request_latency_seconds", "from the HTTP request to a choice's last token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter(
            "spmd_http_choices_finished", "choices finished by the HTTP front, by finish reason",
            ["finish_reason"], registry=self.registry)
        self.engine = EngineStatsCollector()
        self.registry.register(self.engine)

    def render(self, stats: EngineStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
