"""Checks of an EngineConfig that need no weights, run before any process loads a model, so that
a mistake costs a second and one line saying what to change (torch-free)."""
from __future__ import annotations

import errno
import re
import socket
import struct

import msgspec
from spmd_runtime.protocol.config import EngineConfig, engine_config_choices, is_local_address
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.protocol.model_source import ModelSource, config_source_kind, resolve_model


class ConfigError(ValueError):
    """A configuration the engine cannot start with; the message (one line) says what to change."""


def check_config(config: EngineConfig, *, serves_rpc: bool = True) -> None:
    """Raise ConfigError for the first problem found: a value out of range or not one of its
    choices, a model that cannot be found or read, a tensor-parallel size the model's heads do
    not split into, a port on this node that is taken. `serves_rpc`: whether config.rpc_address
    is bound (a launcher that talks to its engine privately does not bind it). Node 0 checks
    everything; other nodes what runs on them (the model, not node 0's ports)."""
    check_values(config)
    check_curve_keys(config)
    source = model_source(config.model)
    if config.quantization == "gguf" and source.kind != "gguf":
        raise ConfigError(f"--quantization gguf keeps a .gguf file's quantized blocks, and "
                          f"{config.model} is not a GGUF file: use --quantization none or int8")
    check_gguf_file(source)
    check_tensor_parallel(config, source)
    if config.node_rank == 0:
        check_ports(config, serves_rpc=serves_rpc)


def resolved_quantization(config: EngineConfig) -> tuple[EngineConfig, str]:
    """--quantization auto made concrete, and why: gguf for a GGUF file whose layers are in
    block types the engine multiplies in place (weight memory = the file's), none otherwise."""
    if config.quantization != "auto":
        return config, "asked for with --quantization"
    source = model_source(config.model)
    if source.kind == "gguf" and config_source_kind(source) == "gguf":
        from spmd_runtime.runtime.loaders.gguf_file import quantized_layer_types

        kinds = quantized_layer_types(source.path)
        if kinds:
            return (msgspec.structs.replace(config, quantization="gguf"),
                    f"auto: the file's layers are {'/'.join(kinds)} blocks, kept as they are")
        return msgspec.structs.replace(config, quantization="none"), "auto: the file is not quantized"
    return msgspec.structs.replace(config, quantization="none"), "auto: not a GGUF file"


def validation_message(error: msgspec.ValidationError, values: dict | None = None) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.max_num_seqs`" as the option to change, with the
    value given when `values` (field name -> value) has it."""
    text = str(error)
    match = re.fullmatch(r"(.*) - at `\$\.(\w+)`", text)
    if match is None:
        return text
    problem, name = match.groups()
    problem = problem.replace("`", "")
    choices = engine_config_choices().get(name)
    if values and name in values and repr(values[name]) not in problem:
        problem += f", got {values[name]!r}"
    if choices:
        problem += f" (choose from {', '.join(choices)})"
    return f"invalid --{name.replace('_', '-')}: {problem[:1].lower()}{problem[1:]}"


def check_values(config: EngineConfig) -> None:
    """Types, ranges and choices: EngineConfig(...) itself checks none of them (decoding does)."""
    try:
        values = msgspec.structs.asdict(config)
        msgspec.convert(values, EngineConfig)
    except msgspec.ValidationError as error:
        raise ConfigError(validation_message(error, values)) from None


def model_source(name: str) -> ModelSource:
    try:
        return resolve_model(name)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def tensor_parallel_problem(model: ModelConfig, size: int) -> str | None:
    """Why `size` ranks cannot split this model's layers, or None if they can."""
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    # Up to one rank per KV head, the heads split whole by KV group (unevenly where the ranks
    # do not divide them); past that, KV heads are replicated and the query heads split evenly.
    if size > kv_heads and heads % size:
        return f"tensor-parallel size {size} must divide the {heads} attention heads"
    if size > kv_heads and size % kv_heads:
        return (f"tensor-parallel size {size} must be at most the {kv_heads} key/value heads or "
                "a multiple of them (then they are replicated)")
    if model.intermediate_size % size:
        return (f"tensor-parallel size {size} must divide the MLP's {model.intermediate_size} "
                "features")
    return None


def check_gguf_file(source: ModelSource) -> None:
    """A GGUF model's header and tensor directory, read (not its weights): a file that is not
    GGUF, is truncated or is corrupt stops here, before any process starts."""
    if config_source_kind(source) != "gguf" or source.kind == "dummy":
        return
    from spmd_runtime.runtime.loaders.gguf_file import GGUFFile

    try:
        GGUFFile(source.path)
    except (ValueError, OSError, struct.error) as error:
        raise ConfigError(str(error).splitlines()[0]) from None


def check_tensor_parallel(config: EngineConfig, source: ModelSource) -> None:
    """The model's config against the world size (one GGUF rank needs no check: the worker
    reads the same config)."""
    size = config.world_size
    if size == 1 and config_source_kind(source) == "gguf":
        return
    from spmd_runtime.runtime.loaders import load_model_config

    try:
        model = load_model_config(source)
    except (ValueError, KeyError, TypeError, OSError) as error:
        detail = f"missing {error}" if isinstance(error, KeyError) else str(error)
        raise ConfigError(f"cannot read the model config of {config.model} ({detail}): fix it "
                          "or pass another --model") from None
    problem = tensor_parallel_problem(model, size)
    if problem is None:
        return
    fits = [n for n in range(1, model.num_attention_heads + 1)
            if tensor_parallel_problem(model, n) is None]
    raise ConfigError(f"{problem} of {config.model} (world size {size} = --nproc-per-node "
                      f"{config.nproc_per_node} x --nnodes {config.nnodes}): use a "
                      f"tensor-parallel size (-tp) of {', '.join(map(str, fits))}")


def _tcp_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// address with a fixed port; None for ipc:// or a port picked at
    bind time (0 or *)."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or int(port) == 0:
        return None
    return ("" if host == "*" else host.strip("[]")), int(port)


def _bind_error(host: str, port: int) -> OSError | None:
    """Why binding host:port fails now, for the reasons a user can act on (in use, privileged);
    None if it binds, or for anything else, which the real bind reports."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        return None
    with socket.socket(family, kind, proto) as probe:
        # As the servers do, so that a port left in TIME_WAIT by a stopped server counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return error if error.errno in (errno.EADDRINUSE, errno.EACCES) else None
    return None


def node0_ports(config: EngineConfig, *, serves_rpc: bool) -> list[tuple[str, str, int]]:
    """(option, host, port) of every fixed TCP port node 0 binds."""
    ports = []
    rpc = _tcp_port(config.rpc_address) if serves_rpc else None
    if rpc:
        ports.append((f"--rpc-address {config.rpc_address}", *rpc))
    if config.http_port:
        ports.append((f"--http-port {config.http_port}", config.http_host, config.http_port))
    if config.master_port:
        # torch.distributed's store listens on every interface.
        ports.append((f"--master-port {config.master_port}", "", config.master_port))
    workers = _tcp_port(config.worker_address)
    if workers:
        ports.append((f"--worker-address {config.worker_address}", *workers))
    elif not config.worker_address and config.nnodes > 1 and config.master_port:
        ports.append((f"--master-port {config.master_port} (+ 1, the scheduler's worker socket)",
                      config.master_addr, config.master_port + 1))
    return ports


def check_ports(config: EngineConfig, *, serves_rpc: bool = True) -> None:
    seen: dict[int, str] = {}
    for option, host, port in node0_ports(config, serves_rpc=serves_rpc):
        if port in seen:
            raise ConfigError(f"{option} and {seen[port]} both use port {port}: give them "
                              "different ports")
        seen[port] = option
        error = _bind_error(host, port)
        if error is None:
            continue
        if error.errno == errno.EACCES:
            raise ConfigError(f"{option}: port {port} needs privileges this user lacks: use a "
                              "port above 1023")
        raise ConfigError(f"{option}: port {port} is already in use on this machine (another "
                          "server?): pick a free port, or stop what holds it")


def check_curve_keys(config: EngineConfig) -> None:
    """--curve-keys readable, with the secret key on node 0 where a socket it binds listens
    beyond loopback."""
    from spmd_runtime.protocol.curve import CurveKeyError, load_keys
    if not config.curve_keys:
        return
    workers = config.worker_address or f"tcp://{config.master_addr}:0"
    binds = [config.rpc_address, workers] if config.node_rank == 0 else []
    need_secret = any(address and not is_local_address(address) for address in binds)
    try:
        load_keys(config.curve_keys, need_secret=need_secret)
    except CurveKeyError as error:
        raise ConfigError(f"--curve-keys: {error}") from None


def security_warnings(config: EngineConfig) -> list[str]:
    """What travels in the clear beyond this host."""
    remote = [address for address in (config.rpc_address, config.worker_address)
              if address and not is_local_address(address)]
    if config.nnodes > 1 and not config.worker_address \
            and not is_local_address(f"tcp://{config.master_addr}:0"):
        remote.append(f"the workers' socket on {config.master_addr}")
    if not remote or config.curve_keys:
        return []
    return [f"{', '.join(remote)} listens beyond loopback unencrypted (prompts, outputs and the "
            "auth token in the clear): make keys with `spmdrun keys DIR` and pass "
            "--curve-keys DIR"]
