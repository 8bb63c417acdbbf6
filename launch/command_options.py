"""The typed options of each subcommand, built from the parsed command line: launch/commands.py
takes these, never an argparse namespace."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

import msgspec
from spmd_runtime.launch.bench import ThroughputWorkload, throughput_workload_from_args
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.model_source import DUMMY_PREFIX
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.preflight import ConfigError


@dataclass(frozen=True)
class GenerateOptions:
    prompts: list[str]
    sampling: SamplingParams
    output: Literal["text", "jsonl"] = "text"
    chat_template: bool = True


@dataclass(frozen=True)
class ServeOptions:
    pass


@dataclass(frozen=True)
class ThroughputBenchOptions:
    workload: ThroughputWorkload
    with_peer: bool = False
    peer_cache: Literal["auto", "same"] = "auto"
    json: bool = False
    peer_api: Literal["manager", "generate_batch"] = "manager"
    peer_threads: int | None = None


@dataclass(frozen=True)
class PrefixBenchOptions:
    num_prefixes: int = 8
    prefix_len: int = 256
    suffix_len: int = 128
    repeat: int = 4
    output_len: int = 16
    workload_seed: int = 0
    rounds: int = 1


@dataclass(frozen=True)
class PressureBenchOptions:
    num_requests: int = 32
    input_len_min: int = 32
    input_len_max: int = 128
    output_len: int = 64
    pressure_blocks: int = 48
    swap_space_gib: float = 1.0
    workload_seed: int = 0
    rounds: int = 1


@dataclass(frozen=True)
class ServingBenchOptions:
    endpoint: Literal["http", "rpc"] = "http"
    url: str = ""
    dataset: Literal["random", "shared-prefix"] = "random"
    num_requests: int = 32
    input_len_min: int = 32
    input_len_max: int = 256
    num_prefixes: int = 4
    prefix_len: int = 128
    suffix_len: int = 32
    output_len: int = 64
    request_rate: float = float("inf")
    max_concurrency: int = 0
    workload_seed: int = 0
    json: bool = False


CommandOptions = (GenerateOptions | ServeOptions | ThroughputBenchOptions | PrefixBenchOptions
                  | PressureBenchOptions | ServingBenchOptions)
_BENCH_OPTIONS = {"prefix": PrefixBenchOptions, "pressure": PressureBenchOptions,
                  "serving": ServingBenchOptions}


def _from_namespace(kind: type, args: argparse.Namespace):
    return kind(**{field.name: getattr(args, field.name) for field in dataclasses.fields(kind)})


def command_options(args: argparse.Namespace) -> CommandOptions:
    """The options of the command the line names (prompts and sampling already resolved for
    generate, see cli.prepare). ConfigError for a workload that contradicts itself."""
    if args.command == "generate":
        return GenerateOptions(args.prompts, args.sampling, args.output,
                               chat_template=not args.no_chat_template)
    if args.command == "serve":
        return ServeOptions()
    if args.bench_kind == "throughput":
        try:
            workload = throughput_workload_from_args(args)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return ThroughputBenchOptions(workload, args.with_peer, args.peer_cache, args.json,
                                      args.peer_api, args.peer_threads)
    return _from_namespace(_BENCH_OPTIONS[args.bench_kind], args)


def bench_model(config: EngineConfig, model_config: str | None, load_format: str,
                model_given: bool) -> EngineConfig:
    """Apply the bench spellings of the model: --model-config PRESET is --model dummy:PRESET,
    --load-format dummy turns --model NAME into dummy:NAME."""
    model = config.model
    if model_config:
        if model_given:
            raise ConfigError("give --model or --model-config, not both")
        model = model_config
    if (load_format == "dummy" or model_config) and not model.startswith(DUMMY_PREFIX):
        model = DUMMY_PREFIX + model
    return msgspec.structs.replace(config, model=model)
