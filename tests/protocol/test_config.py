"""EngineConfig: JSON round trip, strictness, and the CLI generated from its fields."""
from __future__ import annotations

import msgspec
import pytest
from spmd_runtime.launch.cli import LAUNCHER_FIELDS, SERVER_FIELDS, build_parser, config_from_args
from spmd_runtime.protocol.config import (
    OPTION_GROUPS,
    EngineConfig,
    engine_config_choices,
    engine_config_fields,
    is_local_address,
    step_token_budget,
    with_step_budget,
)
from spmd_runtime.runtime.preflight import ConfigError

PREFERRED = {"model": "dummy:smollm2", "dtype": "float32", "device": "cpu", "dummy_seed": 3,
             "block_size": 8, "num_kv_blocks": 24, "gpu_memory_utilization": 0.5,
             "kv_cache_memory": 1 << 30, "kv_swap_memory": 3 << 29, "scheduler": "prefill_first",
             "kv_admission_watermark": 0.05, "execution_mode": "eager", "prompt_bs_bucket": "1,2,4",
             "prompt_seq_bucket": "32,32,64", "decode_bs_bucket": "1,4,8",
             "decode_seq_bucket": "64,64,256", "dist_backend": "gloo",
             "max_num_batched_tokens": 64, "max_num_seqs": 4,
             "max_model_len": 256, "nproc_per_node": 2, "nnodes": 1, "node_rank": 0,
             "master_addr": "127.0.0.2", "master_port": 29500,
             "rpc_address": "tcp://127.0.0.1:5555", "worker_address": "ipc:///tmp/x",
             "step_timeout_s": 12.5, "log_level": "debug",
             "thermal_sensor": "file:/tmp/temp{rank}", "thermal_victims": "largest_kv",
             "thermal_policy": "my_policies:Gentle", "admin_token": "secret", "auth_token": "tok",
             "http_host": "127.0.0.2", "graph_prompt_strategy": "max_bs",
             "graph_decode_strategy": "min_tokens", "attention_backend": "torch",
             "step_pipelining": "overlap", "quantization": "int8", "served_model_name": "my-model",
             "curve_keys": "/tmp/job-keys", "row_parallel_chunks": "auto",
             "tool_call_parser": "hermes", "speculative": "draft",
             "draft_model": "dummy:tiny-llama"}


def _non_default(name: str, kind: type, default):
    """A valid value different from the default (fields added later get a generic one)."""
    if name in PREFERRED and PREFERRED[name] != default:
        return PREFERRED[name]
    if kind is bool:
        return not default
    if kind is int:
        return default + 1
    if kind is float:
        return default / 2
    return f"{default}-x"


NON_DEFAULT = {name: _non_default(name, kind, default)
               for name, kind, default, _ in engine_config_fields()}


def _cli_args(name: str) -> list[str]:
    flag = "--" + name.replace("_", "-")
    value = NON_DEFAULT[name]
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + name.replace("_", "-")]
    return [flag, str(value)]


def test_non_default_sample_differs_from_the_default_everywhere() -> None:
    default = EngineConfig()
    config = EngineConfig.from_json(msgspec.json.encode(NON_DEFAULT))
    for name in NON_DEFAULT:
        assert getattr(config, name) != getattr(default, name), name


def test_json_round_trip() -> None:
    for config in (EngineConfig(), EngineConfig(**NON_DEFAULT)):
        text = config.to_json()
        assert isinstance(text, str)
        assert EngineConfig.from_json(text) == config
        assert EngineConfig.from_json(text.encode()) == config
    assert EngineConfig(**NON_DEFAULT).world_size == NON_DEFAULT["nproc_per_node"] * \
        NON_DEFAULT["nnodes"]


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError, match="max_num_batched_tokenz"):
        EngineConfig.from_json('{"max_num_batched_tokenz": 64}')
    with pytest.raises(TypeError):
        EngineConfig(no_such_option=1)


def test_out_of_range_values_are_rejected_on_decode() -> None:
    with pytest.raises(msgspec.ValidationError, match="block_size"):
        EngineConfig.from_json('{"block_size": 0}')
    with pytest.raises(msgspec.ValidationError, match="gpu_memory_utilization"):
        EngineConfig.from_json('{"gpu_memory_utilization": 1.5}')


def test_field_table_has_types_defaults_and_help() -> None:
    rows = engine_config_fields()
    defaults = EngineConfig()
    for name, kind, default, description in rows:
        assert kind in (int, float, str, bool)
        assert getattr(defaults, name) == default
        assert description, f"{name} has no description (its CLI help)"


def _full_command(subcommand: list[str], names) -> list[str]:
    launcher = [a for n in names if n in LAUNCHER_FIELDS for a in _cli_args(n)]
    engine = [a for n in names if n not in LAUNCHER_FIELDS for a in _cli_args(n)]
    return launcher + subcommand + engine


@pytest.mark.parametrize(("subcommand", "absent"), [
    (["serve"], ()), (["generate", "--prompt", "hi"], SERVER_FIELDS),
    (["bench", "throughput"], SERVER_FIELDS),
    (["bench", "serving"], ("rpc_address", "enable_admin", "admin_token"))])
def test_cli_has_a_flag_for_every_field_the_command_uses(subcommand, absent) -> None:
    names = [name for name, *_ in engine_config_fields() if name not in absent]
    args = build_parser().parse_args(_full_command(subcommand, names))
    assert config_from_args(args) == EngineConfig(**{n: NON_DEFAULT[n] for n in names})
    for name in absent:
        with pytest.raises(SystemExit):
            build_parser().parse_args([*subcommand, *_cli_args(name)])


def test_max_num_batched_tokens_flag_lands_in_config() -> None:
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "64"])
    config = config_from_args(args)
    assert config.max_num_batched_tokens == 64
    # Flags not given keep the EngineConfig defaults.
    assert msgspec.structs.replace(config, max_num_batched_tokens=0) == EngineConfig()


def test_step_token_budget_auto_is_per_device_type() -> None:
    """0 (the default) is 4096 tokens a step on CPU workers, 1024 on CUDA; a budget given is
    kept on both."""
    auto = EngineConfig()
    assert auto.max_num_batched_tokens == 0
    assert step_token_budget(auto, "cpu") == 4096
    assert step_token_budget(auto, "cuda") == 1024
    given = EngineConfig(max_num_batched_tokens=512)
    assert step_token_budget(given, "cpu") == step_token_budget(given, "cuda") == 512
    assert with_step_budget(auto, "cpu").max_num_batched_tokens == 4096
    assert with_step_budget(given, "cuda") == given
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "-1"])
    with pytest.raises(ConfigError, match="invalid --max-num-batched-tokens: expected int >= 0"):
        config_from_args(args)


def test_invalid_flag_value_is_a_clear_exit() -> None:
    args = build_parser().parse_args(["serve", "--max-num-seqs", "0"])
    with pytest.raises(ConfigError, match="invalid --max-num-seqs: expected int >= 1, got 0"):
        config_from_args(args)


def test_config_json_passes_through() -> None:
    config = EngineConfig(**NON_DEFAULT)
    args = build_parser().parse_args(["serve", "--config-json", config.to_json()])
    assert config_from_args(args) == config


def test_defaults_listen_on_loopback_only() -> None:
    config = EngineConfig()
    assert is_local_address(config.rpc_address) and config.http_host == "127.0.0.1"
    assert not config.allow_remote and not config.auth_token


@pytest.mark.parametrize("options", [
    dict(rpc_address="tcp://0.0.0.0:7760"), dict(rpc_address="tcp://*:7760"),
    dict(rpc_address="tcp://10.1.2.3:7760"), dict(http_host="0.0.0.0", http_port=8000),
    dict(worker_address="tcp://192.168.0.7:9000"),
    dict(nnodes=2, master_addr="10.0.0.1", master_port=29500)])
def test_listening_beyond_loopback_needs_allow_remote_and_a_token(options) -> None:
    with pytest.raises(ValueError, match="--allow-remote with --auth-token"):
        EngineConfig(**options)
    with pytest.raises(ValueError, match="needs --auth-token"):
        EngineConfig(allow_remote=True, **options)
    config = EngineConfig(allow_remote=True, auth_token="s3cret", **options)
    assert config.auth_token == "s3cret"


@pytest.mark.parametrize("address", ["ipc:///tmp/x", "inproc://x", "tcp://127.0.0.1:1",
                                     "tcp://127.3.4.5:1", "tcp://localhost:1", "tcp://[::1]:1"])
def test_local_addresses(address) -> None:
    assert is_local_address(address)


# ---------------------------------------------------------------------------- --help sections

def test_every_field_has_exactly_one_help_section() -> None:
    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(name for name, *_ in engine_config_fields())
    assert len(grouped) == len(set(grouped))


def test_fixed_sets_of_values_are_choices_in_the_order_written() -> None:
    choices = engine_config_choices()
    assert choices["dtype"] == ("auto", "float32", "float16", "bfloat16")
    assert choices["device"] == ("auto", "cpu", "cuda")
    assert choices["log_level"] == ("debug", "info", "warning", "error")
    with pytest.raises(msgspec.ValidationError, match="dtype"):
        EngineConfig.from_json('{"dtype": "fp16"}')
