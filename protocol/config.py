"""The one typed configuration object of an engine; CLI flags are generated from its fields."""
from __future__ import annotations

import os
import re
import typing
from typing import Literal

import msgspec
from spmd_runtime.protocol.config_fields import LoggingOptions, option_sections

THERMAL_SENSORS = ("auto", "nvml", "psutil", "none")
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


# Unit suffixes of a size, lower case: K/M/G/T alone and KiB... are binary, KB... decimal.
SIZE_UNITS = {"": 1, "b": 1, **{f"{prefix}{suffix}": base ** (index + 1)
                                for index, prefix in enumerate("kmgt")
                                for suffix, base in (("", 1024), ("ib", 1024), ("b", 1000))}}
SIZE_FORMS = ("bytes (1073741824), or a number with a unit: K, M, G, T or KiB, MiB, GiB, TiB "
              "(powers of 1024), KB, MB, GB, TB (powers of 1000), e.g. 512MiB, 4GiB, 2G, 1.5GB")


def parse_byte_size(text: str, option: str) -> int:
    """Bytes of a size such as "4GiB", "1.5GB", "2g" or "1073741824" (case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in SIZE_UNITS:
        raise ValueError(f"invalid {option} {text!r}: give {SIZE_FORMS}")
    number, unit = match.groups()
    scale = SIZE_UNITS[unit]
    return int(number) * scale if number.isdigit() else int(float(number) * scale)


def is_local_address(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class EngineConfig(LoggingOptions, kw_only=True, forbid_unknown_fields=True):
    """Everything a launcher, scheduler or worker needs to know to start.

    Its fields are declared by domain in protocol/config_fields.py, each in one section of
    --help. Each field's description is its CLI help; `--some-field` on the command line sets
    `some_field`. The launcher passes the whole object to its children as JSON.
    """

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_byte_size(self.kv_cache_memory, "--kv-cache-memory")
        if isinstance(self.row_parallel_chunks, str) and self.row_parallel_chunks != "auto":
            if not self.row_parallel_chunks.isdigit():
                raise ValueError(f"--row-parallel-chunks takes a count or auto, got "
                                 f"{self.row_parallel_chunks!r}")
            self.row_parallel_chunks = int(self.row_parallel_chunks)
        if isinstance(self.kv_swap_memory, str):
            self.kv_swap_memory = parse_byte_size(self.kv_swap_memory, "--kv-swap-memory")
        if self.graph_reserved_mem <= 0:
            raise ValueError("--graph-reserved-mem must be above 0; it no longer turns CUDA graphs "
                             "off: use --execution-mode bucketed (buckets, no graphs) or eager")
        if self.admin_token and not self.enable_admin:
            raise ValueError("an admin token is set but admin calls are off: add --enable-admin "
                             "(enable_admin=True)")
        sensor = self.thermal_sensor
        if sensor not in THERMAL_SENSORS and not (sensor.startswith("file:") and len(sensor) > 5):
            raise ValueError(f"thermal_sensor must be one of {', '.join(THERMAL_SENSORS)} or "
                             f"file:PATH, got {sensor!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--prompt-lookup-min {self.prompt_lookup_min} is above "
                             f"--prompt-lookup-max {self.prompt_lookup_max}")
        if (self.speculative == "draft") != bool(self.draft_model):
            raise ValueError("--speculative draft needs --draft-model MODEL, and --draft-model "
                             "needs --speculative draft")
        if self.quantization == "int8" and self.device == "cuda":
            raise ValueError("--quantization int8 runs on the CPU's kernels: use --device cpu, "
                             "or --quantization none or gguf on CUDA")
        remote = [address for address in (self.rpc_address, self.worker_address,
                                          f"tcp://{self.http_host}:{self.http_port}")
                  if address and not is_local_address(address)]
        if self.nnodes > 1 and not is_local_address(f"tcp://{self.master_addr}:0"):
            remote.append(f"tcp://{self.master_addr} (workers of other nodes)")
        if remote and not self.allow_remote:
            raise ValueError(f"{', '.join(remote)} is reachable from other machines: pass "
                             "--allow-remote with --auth-token SECRET to serve it, or bind to "
                             "127.0.0.1")
        if remote and not self.auth_token:
            raise ValueError(f"--allow-remote needs --auth-token SECRET: {', '.join(remote)} "
                             "would accept anyone")

    def served_name(self) -> str:
        """--served-model-name, else --model as typed, or the file/directory name of a path."""
        if self.served_model_name:
            return self.served_model_name
        model = self.model.removesuffix("/")
        return os.path.basename(model) if os.sep in model else model

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> "EngineConfig":
        return msgspec.json.decode(text, type=cls)

    @classmethod
    def from_values(cls, values: typing.Mapping[str, object]) -> "EngineConfig":
        """The config of these field values, checked as the JSON a child decodes is (types,
        ranges, choices, then __post_init__): the one validation path of the command line and
        LLM. msgspec.ValidationError names the field; EngineConfig(...) itself checks only
        __post_init__'s rules."""
        return msgspec.convert(dict(values), cls)


# The --help section of every field, in the order the sections are shown: the domain
# (protocol/config_fields.py) that declares it.
OPTION_GROUPS: dict[str, tuple[str, ...]] = option_sections()


# What --max-num-batched-tokens 0 (auto) gives CPU workers, and workers on any other device.
# A CPU step is compute-bound from a few hundred prompt tokens on, so a larger budget costs a
# prompt-heavy batch nothing per token; its requests then reach decoding together and decode in
# full batches, where 1,024 spreads their decodes over more, weight-bound steps of fewer rows
# (docs/BENCHMARKS.md: W4 in 22 steps instead of 35). vLLM's CPU backend defaults to 4,096 too.
# On CUDA the prompt buckets and graphs are sized from the budget: 1,024 keeps them as they were.
CPU_STEP_TOKENS, DEVICE_STEP_TOKENS = 4096, 1024


def step_token_budget(config: EngineConfig, device_type: str) -> int:
    """--max-num-batched-tokens, with 0 (auto) made concrete for the workers' device type."""
    if config.max_num_batched_tokens:
        return config.max_num_batched_tokens
    return CPU_STEP_TOKENS if device_type == "cpu" else DEVICE_STEP_TOKENS


def with_step_budget(config: EngineConfig, device_type: str) -> EngineConfig:
    """The config with its step token budget concrete (step_token_budget)."""
    return msgspec.structs.replace(
        config, max_num_batched_tokens=step_token_budget(config, device_type))


def engine_config_fields() -> list[tuple[str, type, object, str]]:
    """(name, type, default, description) of each field, for generating CLI flags."""
    info = msgspec.inspect.type_info(EngineConfig)
    rows = []
    for field in info.fields:
        kind = field.type
        description = ""
        if isinstance(kind, msgspec.inspect.Metadata):
            description = (kind.extra_json_schema or {}).get("description", "") or ""
            kind = kind.type
        if isinstance(kind, (msgspec.inspect.LiteralType, msgspec.inspect.UnionType)):
            rows.append((field.name, str, field.default, description))   # parsed by the struct
            continue
        py_type = {msgspec.inspect.IntType: int, msgspec.inspect.FloatType: float,
                   msgspec.inspect.StrType: str, msgspec.inspect.BoolType: bool}[type(kind)]
        rows.append((field.name, py_type, field.default, description))
    return rows


def engine_config_choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of each field that takes one of a fixed set of strings, in the
    order the field's type lists them."""
    choices = {}
    for name, hint in typing.get_type_hints(EngineConfig).items():
        if typing.get_origin(hint) is Literal:
            choices[name] = typing.get_args(hint)
    return choices
