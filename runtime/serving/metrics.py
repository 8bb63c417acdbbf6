"""Prometheus metrics of the HTTP front: its own latency histograms and the engine's stats.

Where vLLM has the same metric, the name is vLLM's with `spmd:` for `vllm:`, with its buckets
and its `model_name` label, so a vLLM dashboard works by changing the prefix (docs/SERVING.md
has the mapping). Metrics vLLM has no counterpart of keep the `spmd_` prefix.

Engine figures are read with one stats call per scrape and exposed through a collector, so
counters kept by the scheduler stay counters here without being mirrored.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from spmd_runtime.protocol.messages import EngineStats

# vLLM's buckets, so that histograms from both engines can be charted and compared as they are.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
MODEL_LABEL = "model_name"


class EngineStatsCollector:
    """Yields the last EngineStats snapshot as Prometheus families (nothing before the first)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def describe(self) -> list:
        return []   # families depend on the snapshot (thermal ones only with a reading)

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        for kind, name, documentation, value in engine_figures(stats):
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, documentation, labels=[MODEL_LABEL])
            family.add_metric([self.model_name], value)
            yield family
        if stats.speculative:
            family = CounterMetricFamily("spmd:spec_decode_num_accepted_tokens_per_pos",
                                         "proposals accepted, by their position in the draft",
                                         labels=[MODEL_LABEL, "position"])
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                family.add_metric([self.model_name, str(position)], count)
            yield family
        if any(t is not None for t in stats.rank_temps_c):
            family = GaugeMetricFamily("spmd_rank_temperature_celsius",
                                       "each rank's last temperature reading",
                                       labels=[MODEL_LABEL, "rank"])
            for rank, temp in enumerate(stats.rank_temps_c):
                if temp is not None:
                    family.add_metric([self.model_name, str(rank)], temp)
            yield family


def engine_figures(stats: EngineStats) -> list[tuple[str, str, str, float]]:
    """(kind, name, documentation, value) of every engine figure /metrics shows."""
    kv_usage = stats.kv_blocks_in_use / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    figures = [
        ("gauge", "spmd:num_requests_running", "requests in the running batch", stats.num_running),
        ("gauge", "spmd:num_requests_waiting", "requests waiting to be admitted", stats.num_waiting),
        ("gauge", "spmd:kv_cache_usage_perc", "share of the device KV blocks in use (1 = all)",
         kv_usage),
        ("counter", "spmd:prompt_tokens", "prompt tokens admitted", stats.num_prompt_tokens),
        ("counter", "spmd:generation_tokens", "tokens generated", stats.num_generated_tokens),
        ("counter", "spmd:num_preemptions", "preemptions (swaps out and soft resets)",
         stats.num_preemptions),
        ("counter", "spmd:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
         stats.prefix_cache_queries),
        ("counter", "spmd:prefix_cache_hits", "prompt tokens served from the prefix cache",
         stats.prefix_cache_hits),
        *_spec_decode_figures(stats),
        # No vLLM counterpart from here on.
        ("gauge", "spmd_num_requests_swapped",
         "preempted requests whose KV blocks wait in the CPU pool", stats.num_swapped),
        ("gauge", "spmd_kv_blocks_total", "device KV-cache blocks", stats.kv_blocks_total),
        ("gauge", "spmd_prefix_cache_hit_rate",
         "prompt tokens served from the prefix cache / looked up", stats.prefix_cache_hit_rate),
        ("gauge", "spmd_max_num_seqs", "configured cap on running requests (or as set by admin)",
         stats.max_num_seqs),
        ("gauge", "spmd_running_cap", "running requests allowed now, thermal cap included",
         stats.running_cap),
        ("gauge", "spmd_thermal_throttling", "1 while the thermal policy shrinks the batch",
         int(stats.thermal_throttling)),
        ("gauge", "spmd_thermal_target_celsius", "hottest-device temperature the policy aims under",
         stats.thermal_target_c),
        ("counter", "spmd_engine_finished_requests", "requests finished by the engine",
         stats.num_finished),
        ("counter", "spmd_thermal_evictions", "requests taken off the batch by the thermal policy",
         stats.thermal_evictions),
        ("counter", "spmd_admin_evictions", "requests taken off the batch by admin calls",
         stats.admin_evictions),
    ]
    if stats.max_temp_c is not None:
        figures.append(("gauge", "spmd_max_temperature_celsius", "hottest device of the group",
                        stats.max_temp_c))
    if stats.power_w is not None:
        figures.append(("gauge", "spmd_power_watts", "the group's power draw", stats.power_w))
    return figures


def _spec_decode_figures(stats: EngineStats) -> list[tuple[str, str, str, float]]:
    """vLLM's spec_decode counters, where speculative decoding is on."""
    if not stats.speculative:
        return []
    return [
        ("counter", "spmd:spec_decode_num_drafts", "steps x requests that verified proposals",
         stats.spec_decode_num_drafts),
        ("counter", "spmd:spec_decode_num_draft_tokens", "tokens proposed",
         stats.spec_decode_num_draft_tokens),
        ("counter", "spmd:spec_decode_num_accepted_tokens", "proposed tokens accepted",
         stats.spec_decode_num_accepted_tokens),
    ]


class ServingMetrics:
    """Everything /metrics shows, in a registry of its own, labelled with the served model."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]):
            return Histogram(name, documentation, [MODEL_LABEL], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "spmd:time_to_first_token_seconds", "from the HTTP request to a choice's first token",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "spmd:inter_token_latency_seconds", "between consecutive output tokens of a choice",
            INTER_TOKEN_BUCKETS)
        self.request_latency = histogram(
            "spmd:e2e_request_latency_seconds", "from the HTTP request to a choice's last token",
            REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "spmd:request_queue_time_seconds",
            "from a request's arrival at the scheduler to its first scheduled step",
            REQUEST_LATENCY_BUCKETS)
        self._finished = Counter(
            "spmd:request_success", "choices finished by the HTTP front, by finish reason",
            [MODEL_LABEL, "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.engine = EngineStatsCollector(model_name)
        self.registry.register(self.engine)

    def count_finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def render(self, stats: EngineStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
