"""--kv-cache-memory takes a size with a unit (K/M/G/T and KiB.. binary, KB.. decimal, any case)
or plain bytes; an int still works from Python; a bad value is refused listing the forms."""
from __future__ import annotations

import msgspec
import pytest
from spmd_runtime.launch.cli import build_parser, config_from_args
from spmd_runtime.protocol.config import EngineConfig, parse_byte_size
from spmd_runtime.runtime.preflight import ConfigError

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(("text", "size"), [
    ("1073741824", GIB), ("0", 0), ("512b", 512),
    ("4GiB", 4 * GIB), ("512MiB", 512 * MIB), ("64mib", 64 * MIB), ("3KiB", 3 * KIB),
    ("1TiB", TIB),
    ("2G", 2 * GIB), ("2g", 2 * GIB), ("8M", 8 * MIB), ("1k", KIB), ("1T", TIB),
    ("1.5GB", 1_500_000_000), ("2gb", 2_000_000_000), ("10MB", 10_000_000), ("1KB", 1000),
    ("3TB", 3 * 10**12), ("0.5GiB", GIB // 2), (".25M", MIB // 4), (" 4 GiB ", 4 * GIB),
])
def test_sizes(text: str, size: int) -> None:
    assert parse_byte_size(text, "--kv-cache-memory") == size
    assert EngineConfig(kv_cache_memory=text).kv_cache_memory == size


@pytest.mark.parametrize("text", ["", "GiB", "-1G", "4XB", "4 GiBs", "1e9", "four", "1.2.3G",
                                  "4iB"])
def test_bad_sizes_are_refused_listing_the_forms(text: str) -> None:
    with pytest.raises(ValueError) as refused:
        EngineConfig(kv_cache_memory=text)
    message = str(refused.value)
    assert message.startswith(f"invalid --kv-cache-memory {text!r}"), message
    for form in ("bytes", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "512MiB", "1.5GB"):
        assert form in message, message


def test_an_int_still_works_and_json_carries_bytes() -> None:
    assert EngineConfig(kv_cache_memory=GIB).kv_cache_memory == GIB
    config = EngineConfig(kv_cache_memory="4GiB")
    assert msgspec.json.decode(config.to_json())["kv_cache_memory"] == 4 * GIB
    assert EngineConfig.from_json(config.to_json()) == config
    decoded = EngineConfig.from_json(b'{"kv_cache_memory": "2G"}')
    assert decoded.kv_cache_memory == 2 * GIB
    with pytest.raises(msgspec.ValidationError):
        EngineConfig.from_json(b'{"kv_cache_memory": -1}')


def test_the_flag_takes_a_unit() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "512MiB"])
    assert config_from_args(args).kv_cache_memory == 512 * MIB
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "4XB"])
    with pytest.raises(ConfigError, match=r"invalid --kv-cache-memory '4XB': give bytes"):
        config_from_args(args)
