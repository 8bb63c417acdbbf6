"""/metrics' engine families from a stats snapshot: speculative decoding's counters under vLLM's
spec_decode names (prefix spmd: for vllm:), there only when speculation is on."""
from __future__ import annotations

import types
import typing

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from spmd_runtime.protocol.messages import EngineStats
from spmd_runtime.runtime.serving.metrics import EngineStatsCollector


def _zero(kind):
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return None
    if typing.get_origin(kind) is list:
        return []
    return {int: 0, float: 0.0, str: "", bool: False}[kind]


def snapshot(**values) -> EngineStats:
    """A stats reply with every required figure zero, but `values`."""
    required = {f.name: _zero(f.type) for f in msgspec.structs.fields(EngineStats) if f.required}
    return EngineStats(**{**required, "kv_blocks_total": 1, **values})


def exposed(stats: EngineStats) -> str:
    registry = CollectorRegistry()
    collector = EngineStatsCollector("smollm2")
    collector.stats = stats
    registry.register(collector)
    return generate_latest(registry).decode()


def test_spec_decode_counters_use_vllms_names_with_the_spmd_prefix() -> None:
    text = exposed(snapshot(speculative="ngram", spec_decode_num_drafts=5,
                            spec_decode_num_draft_tokens=20, spec_decode_num_accepted_tokens=13,
                            spec_decode_num_accepted_tokens_per_pos=[5, 4, 3, 1]))
    assert 'spmd:spec_decode_num_drafts_total{model_name="smollm2"} 5.0' in text
    assert 'spmd:spec_decode_num_draft_tokens_total{model_name="smollm2"} 20.0' in text
    assert 'spmd:spec_decode_num_accepted_tokens_total{model_name="smollm2"} 13.0' in text
    for position, count in enumerate([5, 4, 3, 1]):
        assert (f'spmd:spec_decode_num_accepted_tokens_per_pos_total{{model_name="smollm2",'
                f'position="{position}"}} {float(count)}') in text


def test_without_speculation_there_is_no_spec_decode_family() -> None:
    assert "spec_decode" not in exposed(snapshot())


def test_stats_report_acceptance_rate_and_tokens_per_step() -> None:
    stats = snapshot(speculative="ngram", spec_decode_num_drafts=5, spec_decode_num_draft_tokens=20,
                     spec_decode_num_accepted_tokens=13)
    assert stats.spec_decode_acceptance_rate == 13 / 20
    assert stats.spec_decode_tokens_per_draft == 1 + 13 / 5
    assert "13 of 20 proposed tokens accepted (65.0%), 3.60 tokens per verifying step" in str(stats)
    assert "speculative:  off" in str(snapshot())
