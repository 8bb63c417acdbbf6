"""One option per decision: the old spellings map onto the new options with a warning, on the
command line and as LLM keywords; the new options decide what runs."""
from __future__ import annotations

import pytest
from spmd_runtime.launch.cli import build_parser, config_from_args, parse_command_line
from spmd_runtime.launch.options import deprecation_warnings
from spmd_runtime.protocol.buckets import bucketing_enabled, compiling, graphs_enabled
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.deprecated_options import DEPRECATED_OPTIONS, replace_deprecated
from spmd_runtime.runtime.llm import LLM
from spmd_runtime.runtime.preflight import ConfigError


@pytest.mark.parametrize(("old", "new"), [
    ({"bucketing": "on"}, {"execution_mode": "bucketed"}),
    ({"bucketing": "off"}, {"execution_mode": "eager"}),
    ({"bucketing": "auto"}, {"execution_mode": "auto"}),
    ({"compile": True}, {"execution_mode": "compiled"}),
    ({"compile": False}, {"execution_mode": "auto"}),
    ({"compile": True, "bucketing": "off"}, {"execution_mode": "eager"}),
    ({"enforce_eager": True}, {"execution_mode": "eager"}),
    ({"enforce_eager": True, "bucketing": "on", "compile": True}, {"execution_mode": "bucketed"}),
    ({"async_scheduling": False}, {"step_pipelining": "off"}),
    ({"async_scheduling": False, "overlap_steps": "on"}, {"step_pipelining": "off"}),
    ({"async_scheduling": True}, {"step_pipelining": "auto"}),
    ({"overlap_steps": "on"}, {"step_pipelining": "overlap"}),
    ({"overlap_steps": "off"}, {"step_pipelining": "schedule_ahead"}),
    ({"overlap_steps": "auto"}, {"step_pipelining": "auto"}),
    ({"swap_space": 1.5}, {"kv_swap_memory": 3 << 29}),
    ({"admin_token": "s3cret"}, {"admin_token": "s3cret", "enable_admin": True}),
])
def test_each_old_spelling_maps_onto_its_new_option_and_warns(old, new) -> None:
    values, warnings = replace_deprecated(old)
    assert values == new
    assert len(warnings) == len(old) and all("deprecated" in w for w in warnings)


def test_new_options_pass_through_without_a_warning() -> None:
    new = {"execution_mode": "compiled", "step_pipelining": "overlap",
           "kv_swap_memory": "1GiB", "enable_admin": True, "admin_token": "s3cret"}
    assert replace_deprecated(new) == (new, [])


@pytest.mark.parametrize("values", [
    {"compile": True, "execution_mode": "eager"},
    {"overlap_steps": "on", "step_pipelining": "off"},
    {"swap_space": 1.0, "kv_swap_memory": "1GiB"},
    {"bucketing": "maybe"}])
def test_an_old_spelling_with_its_new_option_or_a_bad_value_is_refused(values) -> None:
    with pytest.raises(ValueError, match="--"):
        replace_deprecated(values)


def test_old_flags_on_the_command_line_warn_and_land_in_the_new_options() -> None:
    args = parse_command_line(build_parser(), [
        "serve", "--compile", "--no-async-scheduling", "--swap-space", "0.5"])
    config = config_from_args(args)
    assert (config.execution_mode, config.step_pipelining, config.kv_swap_memory) == (
        "compiled", "off", 2**29)
    warnings = deprecation_warnings(args)
    assert len(warnings) == 3
    assert any("--execution-mode compiled" in w for w in warnings)
    with pytest.raises(ConfigError, match="give --execution-mode alone"):
        config_from_args(parse_command_line(build_parser(), [
            "serve", "--enforce-eager", "--execution-mode", "compiled"]))


def test_help_shows_the_domains_and_the_deprecated_spellings_apart(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for section in ("execution: eager, buckets, compilation, graphs", "KV cache & memory",
                    "deprecated spellings"):
        assert section in text
    deprecated = text[text.index("deprecated spellings"):]
    for option in DEPRECATED_OPTIONS:
        assert f"--{option.replace('_', '-')}" in deprecated


def test_llm_keywords_take_the_old_spellings_with_a_deprecation_warning(monkeypatch) -> None:
    built = []
    monkeypatch.setattr("spmd_runtime.runtime.llm.check_config", built.append)
    monkeypatch.setattr("spmd_runtime.runtime.llm.spawn_python",
                        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.warns(DeprecationWarning, match="--execution-mode eager"):
        with pytest.raises(RuntimeError, match="stop"):
            LLM("dummy:tiny-llama", enforce_eager=True)
    assert built[0].execution_mode == "eager"


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
