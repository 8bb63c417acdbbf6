"""One option per decision: the old spellings are refused, on the command line and as LLM
keywords, in one line naming the option that replaced each; the new options decide what runs."""
from __future__ import annotations

import pytest
from spmd_runtime.launch.cli import build_parser, config_from_args, parse_command_line
from spmd_runtime.protocol.buckets import bucketing_enabled, compiling, graphs_enabled
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.deprecated_options import REMOVED_OPTIONS
from spmd_runtime.runtime.llm import LLM
from spmd_runtime.runtime.preflight import ConfigError

REMOVED = [  # (the spelling on the command line, as an LLM keyword, what replaced it)
    (["--bucketing", "on"], {"bucketing": "on"}, "--execution-mode"),
    (["--compile"], {"compile": True}, "--execution-mode compiled"),
    (["--no-enforce-eager"], {"enforce_eager": False}, "--execution-mode eager"),
    (["--no-async-scheduling"], {"async_scheduling": False}, "--step-pipelining"),
    (["--overlap-steps", "off"], {"overlap_steps": "off"}, "--step-pipelining"),
    (["--swap-space", "0.5"], {"swap_space": 0.5}, "--kv-swap-memory"),
]


@pytest.mark.parametrize(("flags", "keyword", "replacement"), REMOVED)
def test_a_removed_spelling_is_refused_in_one_line_naming_its_replacement(
        flags, keyword, replacement, monkeypatch) -> None:
    args = parse_command_line(build_parser(), ["serve", *flags])
    with pytest.raises(ConfigError) as refused:
        config_from_args(args)
    message = str(refused.value)
    assert message == f"{flags[0].replace('--no-', '--')} was removed: use " + \
        REMOVED_OPTIONS[next(iter(keyword))].replacement
    assert replacement in message and "\n" not in message
    monkeypatch.setattr("spmd_runtime.runtime.llm.spawn_python",
                        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("started")))
    with pytest.raises(ValueError, match=f"was removed: use {replacement}"):
        LLM("dummy:tiny-llama", **keyword)


def test_help_shows_the_domains_and_no_removed_spelling(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for section in ("execution: eager, buckets, compilation, graphs", "KV cache & memory"):
        assert section in text
    for option in REMOVED_OPTIONS.values():
        assert option.flag not in text


def test_an_admin_token_alone_is_refused_on_the_command_line_too() -> None:
    with pytest.raises(ConfigError, match="add --enable-admin"):
        config_from_args(parse_command_line(build_parser(), ["serve", "--admin-token", "s3"]))
    config = config_from_args(parse_command_line(
        build_parser(), ["serve", "--enable-admin", "--admin-token", "s3"]))
    assert config.enable_admin and config.admin_token == "s3"


@pytest.mark.parametrize(("mode", "device", "bucketed", "compiled", "graphs"), [
    ("auto", "cpu", False, False, False), ("auto", "cuda", True, False, True),
    ("eager", "cuda", False, False, False), ("bucketed", "cpu", True, False, False),
    ("bucketed", "cuda", True, False, False), ("compiled", "cpu", True, True, False),
    ("compiled", "cuda", True, False, True)])
def test_execution_mode_alone_decides_buckets_compilation_and_graphs(
        mode, device, bucketed, compiled, graphs) -> None:
    config = EngineConfig(execution_mode=mode)
    assert bucketing_enabled(config, device) == bucketed
    assert compiling(config, device) == compiled
    assert graphs_enabled(config, device) == graphs


def test_graph_memory_and_admin_token_are_no_hidden_switches() -> None:
    with pytest.raises(ValueError, match="--execution-mode bucketed"):
        EngineConfig(graph_reserved_mem=0.0)
    with pytest.raises(ValueError, match="add --enable-admin"):
        EngineConfig(admin_token="s3cret")
    assert EngineConfig(enable_admin=True, admin_token="s3cret").enable_admin
