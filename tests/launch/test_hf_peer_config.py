"""The transformers peer's continuous-batching config (launch/hf_peer.py) is built from the
options the installed transformers takes: against its real ContinuousBatchingConfig, and
against a stand-in with 5.17's fields (no auto_switch_to_flash, block_size for page_size).
No model is loaded."""
from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest
from spmd_runtime.launch import hf_peer

# transformers 5.17.0's ContinuousBatchingConfig fields, in order (generation/configuration_utils.py).
FIELDS_5_17 = (
    "block_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
    "max_blocks_per_request", "allow_block_sharing", "use_async_batching", "use_cuda_graph",
    "q_padding_interval_size", "kv_padding_interval_size", "varlen_compile_config",
    "decode_compile_config", "default_compile_level", "scheduler_type", "safety_margin",
    "return_logprobs", "seed", "cpu_offload_space", "cpu_offload_space_safety_threshold",
    "max_queue_size", "per_request_processors", "drop_unsupported_processors",
    "disable_nccl_graph_mixing", "cpu_group_timeout", "use_default_compile_configs",
    "max_cached_graphs",
)
Config517 = dataclasses.make_dataclass(
    "ContinuousBatchingConfig",
    [(name, object, dataclasses.field(default=256 if name == "block_size" else None))
     for name in FIELDS_5_17])


class RecordingModel:
    """Stands in for a transformers model: records the attention implementations set on it."""

    def __init__(self) -> None:
        self.attention = [hf_peer.ATTENTION]

    def set_attn_implementation(self, name: str) -> None:
        self.attention.append(name)


def test_the_installed_transformers_takes_every_option_it_has() -> None:
    from transformers import ContinuousBatchingConfig

    accepted = set(inspect.signature(ContinuousBatchingConfig.__init__).parameters)
    assert hf_peer.accepted_options(ContinuousBatchingConfig) == accepted - {"self"}
    config = hf_peer.batching_config(max_batch_tokens=512, kv_tokens=1000)
    assert isinstance(config, ContinuousBatchingConfig)
    assert config.max_batch_tokens == 512
    page = getattr(config, "page_size", None) or config.block_size
    assert config.num_blocks == -(-1000 // page)
    if "auto_switch_to_flash" in accepted:
        assert config.auto_switch_to_flash is False
    # Without sizes, transformers' own defaults stay.
    assert hf_peer.batching_config().max_batch_tokens is None


def test_a_5_17_config_gets_the_options_it_takes_and_no_type_error(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="spmd.launch"):
        config = hf_peer.batching_config(max_batch_tokens=8192, kv_tokens=2176,
                                         config_class=Config517)
    assert config.max_batch_tokens == 8192
    assert config.num_blocks == 9, "2176 tokens in pages of block_size 256"
    assert not hasattr(config, "auto_switch_to_flash")
    assert "takes no auto_switch_to_flash" in caplog.text


def test_an_option_a_version_lacks_is_left_out_and_logged(caplog) -> None:
    class NoBudget:
        def __init__(self, page_size: int = 16, num_blocks: int | None = None) -> None:
            self.page_size, self.num_blocks = page_size, num_blocks

    with caplog.at_level(logging.INFO, logger="spmd.launch"):
        config = hf_peer.batching_config(max_batch_tokens=64, kv_tokens=40, config_class=NoBudget)
    assert config.num_blocks == 3
    assert "takes no max_batch_tokens" in caplog.text


def test_without_auto_switch_to_flash_the_model_is_held_on_paged_sdpa_for_the_run() -> None:
    model = RecordingModel()
    with pytest.raises(RuntimeError, match="run failed"), \
            hf_peer.sdpa_held(model, hf_peer.batching_config(config_class=Config517)):
        assert model.attention[-1] == f"paged|{hf_peer.ATTENTION}"
        raise RuntimeError("run failed")
    assert model.attention[-1] == hf_peer.ATTENTION, "put back on sdpa, even after a failure"

    # Where the config has the option (False), the config keeps sdpa: the model is not touched.
    model = RecordingModel()
    Config519 = dataclasses.make_dataclass("ContinuousBatchingConfig", [
        ("auto_switch_to_flash", bool, dataclasses.field(default=True))], bases=(Config517,))
    config = hf_peer.batching_config(config_class=Config519)
    assert config.auto_switch_to_flash is False
    with hf_peer.sdpa_held(model, config):
        pass
    assert model.attention == [hf_peer.ATTENTION]
