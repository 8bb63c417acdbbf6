"""From parsed command-line arguments to what a command runs: the EngineConfig (with the
-tp alias and tokens from the environment), sampling parameters and prompts."""
from __future__ import annotations

import argparse
import os

import msgspec
from spmd_runtime.protocol.config import EngineConfig, engine_config_fields
from spmd_runtime.protocol.config_resolve import environment_options
from spmd_runtime.protocol.deprecated_options import refuse_removed
from spmd_runtime.protocol.env_vars import SPMD_ADMIN_TOKEN, SPMD_API_KEY
from spmd_runtime.protocol.model_source import config_source_kind
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.preflight import ConfigError, model_source, validation_message

# Secrets read from the environment when not given as options (argv is visible in `ps`).
TOKEN_VARIABLES = {"auth_token": ("--auth-token", SPMD_API_KEY),
                   "admin_token": ("--admin-token", SPMD_ADMIN_TOKEN)}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the options given (the others keep their defaults); ConfigError
    for a value out of range, or -tp that the nodes do not split evenly."""
    if getattr(args, "config_json", None):
        try:
            return EngineConfig.from_json(args.config_json)
        except msgspec.ValidationError as error:
            raise ConfigError(validation_message(error)) from None
    values = _option_values(args)
    try:
        return EngineConfig.from_values(values)
    except msgspec.ValidationError as error:
        raise ConfigError(validation_message(error, values)) from None


def _option_values(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given, then those the environment sets (tokens, option
    variables: protocol/config_resolve.py); ConfigError for a removed spelling."""
    names = {name for name, *_ in engine_config_fields()}
    try:
        refuse_removed(vars(args))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(_tensor_parallel(values, getattr(args, "tensor_parallel_size", None)))
    for field, (_, variable) in TOKEN_VARIABLES.items():
        # The admin token only where admin calls are asked for (--enable-admin).
        wanted = field != "admin_token" or values.get("enable_admin")
        if field not in values and os.environ.get(variable) and wanted:
            values[field] = os.environ[variable]
    try:
        return {**environment_options(values), **values}
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _tensor_parallel(values: dict, size: int | None) -> dict:
    """-tp N is the total tensor-parallel size: N / --nnodes workers per node."""
    if size is None:
        return {}
    nnodes = values.get("nnodes", 1)
    if size < 1 or size % nnodes:
        raise ConfigError(f"-tp {size} must be a positive multiple of --nnodes {nnodes} (each "
                          "node runs the same number of workers)")
    given = values.get("nproc_per_node")
    if given is not None and given * nnodes != size:
        raise ConfigError(f"-tp {size} and --nproc-per-node {given} x --nnodes {nnodes} "
                          "disagree: give one of them")
    return {"nproc_per_node": size // nnodes}


def token_warnings(args: argparse.Namespace) -> list[str]:
    """One warning per secret given on the command line (never the secret itself)."""
    return [f"{flag} on the command line is visible to other users of this machine (ps); "
            f"set {variable} instead" for field, (flag, variable) in TOKEN_VARIABLES.items()
            if field in vars(args)]


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def prompts_from_args(args: argparse.Namespace, model: str) -> list[str]:
    """The positional prompts, then --prompt, then --prompt-file's non-empty lines."""
    prompts = [*args.prompts, *args.prompt]
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as handle:
                prompts.extend(line.rstrip("\n") for line in handle if line.strip())
        except OSError as error:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {error.strerror or error}: "
                              "give a readable file with one prompt per line") from None
    if not prompts:
        raise ConfigError('give a prompt: spmdrun generate "PROMPT", --prompt PROMPT '
                          "(repeatable) or --prompt-file FILE")
    if config_source_kind(model_source(model)) == "preset":
        raise ConfigError(f"{model} has random weights in a built-in shape and no tokenizer, so "
                          "it cannot read text prompts: use a model with a tokenizer (e.g. "
                          "dummy:smollm2), or send token ids with bench or the Python Client")
    return prompts
