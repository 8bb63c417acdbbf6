"""The one typed configuration object of an engine; CLI flags are generated from its fields."""
from __future__ import annotations

import os
import re
import typing
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

THERMAL_SENSORS = ("auto", "nvml", "psutil", "none")
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


# The --help section of every field, in the order the sections are shown.
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "device", "quantization", "dummy_seed"),
    "parallelism & launcher": (
        "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "worker_address",
        "dist_backend", "dist_timeout_s", "row_parallel_chunks", "row_parallel_chunk_threshold"),
    "scheduling & batching": (
        "scheduler", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
        "async_scheduling", "overlap_steps"),
    "KV cache & memory": (
        "block_size", "num_kv_blocks", "gpu_memory_utilization", "kv_cache_memory", "swap_space",
        "kv_admission_watermark", "enable_prefix_caching"),
    "graphs & compilation": (
        "attention_backend", "bucketing", "prompt_bs_bucket", "prompt_seq_bucket",
        "decode_bs_bucket", "decode_seq_bucket", "skip_warmup", "compile", "enforce_eager",
        "graph_reserved_mem", "graph_prompt_ratio", "graph_prompt_strategy",
        "graph_decode_strategy"),
    "thermal": (
        "thermal_sensor", "thermal_interval_steps", "thermal_target_c", "thermal_hysteresis_c",
        "thermal_kp", "thermal_policy", "thermal_victims"),
    "fault tolerance": ("step_timeout_s", "heartbeat_timeout_s", "max_restarts"),
    "serving & network": (
        "served_model_name", "rpc_address", "http_host", "http_port", "max_message_bytes"),
    "security": ("allow_remote", "auth_token", "enable_admin", "admin_token"),
    "logging": ("log_level",),
}


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


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything a launcher, scheduler or worker needs to know to start.

    Each field's description is its CLI help; `--some-field` on the command line sets
    `some_field`. The launcher passes the whole object to its children as JSON.
    """

    model: Annotated[str, Meta(description=(
        "model to serve: 'smollm2' (embedded), a .gguf file, a Hugging Face directory, "
        "or dummy:<one of those> for random weights"))] = "smollm2"
    dtype: Annotated[Literal["auto", "float32", "float16", "bfloat16"], Meta(description=(
        "weight and activation dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
        "float16 or bfloat16"))] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], Meta(description=(
        "auto: cuda where available, else cpu"))] = "auto"
    dummy_seed: Annotated[int, Meta(description="seed of the random weights of dummy: models")] = 0
    block_size: Annotated[int, Meta(ge=1, description="tokens per KV-cache block")] = 16
    num_kv_blocks: Annotated[int, Meta(ge=0, description=(
        "KV-cache blocks per worker; 0 sizes the pool from profiled free memory"))] = 0
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1, description=(
        "share of the memory left free after loading the weights and a profiling forward pass "
        "that a CUDA worker may use for activations and KV cache (a CPU worker's cache is "
        "sized by --kv-cache-memory)"))] = 0.9
    # A size with a unit ("4GiB") on the command line or in JSON; an int of bytes once built.
    kv_cache_memory: Annotated[Annotated[int, Meta(ge=0)] | str, Meta(description=(
        "KV cache per worker, set outright (overrides --gpu-memory-utilization): bytes, or a "
        "size such as 512MiB, 4GiB, 2G or 1.5GB; 0: on CUDA sized from free memory, on CPU "
        "2GiB, or a quarter of the available RAM shared by the node's workers if smaller"))] = 0
    swap_space: Annotated[float, Meta(ge=0, description=(
        "GiB of CPU memory per worker that preempted requests' KV blocks are offloaded to "
        "(pinned on CUDA); 0 preempts by soft reset (recompute) only"))] = 0.0
    scheduler: Annotated[Literal["fifo", "prefill_first"], Meta(description=(
        "fifo: running decodes, then unfinished prefills, then waiting requests in arrival "
        "order; prefill_first: unfinished prefills before decodes"))] = "fifo"
    kv_admission_watermark: Annotated[float, Meta(ge=0, lt=1, description=(
        "share of KV blocks kept spare when admitting a request (or resuming a swapped one) "
        "while others run, so running requests can grow without preemption"))] = 0.2
    max_num_batched_tokens: Annotated[int, Meta(ge=1, description=(
        "token budget of one step; longer prompts are prefilled in chunks"))] = 1024
    enable_prefix_caching: Annotated[bool, Meta(description=(
        "reuse the KV cache of shared prompt prefixes across requests"))] = True
    max_num_seqs: Annotated[int, Meta(ge=1, description="most requests running at once")] = 64
    max_model_len: Annotated[int, Meta(ge=0, description=(
        "longest prompt + output in tokens; 0 uses the model's context length"))] = 0
    bucketing: Annotated[Literal["auto", "on", "off"], Meta(description=(
        "pad every batch to one of a few (batch size, length) buckets and warm them all up "
        "before serving; a step is then either a prompt step or a decode step. auto: on "
        "with --compile, and on CUDA (for its graphs) unless --enforce-eager"))] = "auto"
    prompt_bs_bucket: Annotated[str, Meta(description=(
        "'min,step,max' of prompt batch-size buckets; empty: SPMD_PROMPT_BS_BUCKET_{MIN,STEP,MAX} "
        "or a default from max_num_seqs"))] = ""
    prompt_seq_bucket: Annotated[str, Meta(description=(
        "'min,step,max' of prompt sequence-length buckets; empty: "
        "SPMD_PROMPT_SEQ_BUCKET_{MIN,STEP,MAX} or a default from max_num_batched_tokens"))] = ""
    decode_bs_bucket: Annotated[str, Meta(description=(
        "'min,step,max' of decode batch-size buckets; empty: SPMD_DECODE_BS_BUCKET_{MIN,STEP,MAX} "
        "or a default from max_num_seqs"))] = ""
    decode_seq_bucket: Annotated[str, Meta(description=(
        "'min,step,max' of decode context-length buckets (tokens); empty: "
        "SPMD_DECODE_SEQ_BUCKET_{MIN,STEP,MAX} or a default from max_model_len"))] = ""
    skip_warmup: Annotated[bool, Meta(description=(
        "serve without running every bucket first (the first batch of each shape then pays "
        "for compilation)"))] = False
    compile: Annotated[bool, Meta(description=(
        "on CPU, compile the model's dense layers with torch.compile(dynamic=False) for each "
        "bucket at warmup; attention stays eager"))] = False
    enforce_eager: Annotated[bool, Meta(description=(
        "never compile or capture graphs, whatever else is set"))] = False
    graph_reserved_mem: Annotated[float, Meta(ge=0, lt=1, description=(
        "on CUDA with bucketing, share of the usable memory set aside for captured graphs "
        "before the KV cache is sized; 0 captures none"))] = 0.1
    graph_prompt_ratio: Annotated[float, Meta(ge=0, le=1, description=(
        "share of the graph memory first offered to prompt graphs (the rest to decode "
        "graphs); what one phase leaves unused goes to the other in a second pass"))] = 0.3
    graph_prompt_strategy: Annotated[Literal["min_tokens", "max_bs"], Meta(description=(
        "order prompt graphs are captured in until their memory is spent: min_tokens "
        "(batch size x length ascending) or max_bs (batch size descending, then length "
        "ascending)"))] = "min_tokens"
    graph_decode_strategy: Annotated[Literal["min_tokens", "max_bs"], Meta(description=(
        "order decode graphs are captured in (see --graph-prompt-strategy); max_bs first "
        "captures the large batches a loaded server decodes"))] = "max_bs"
    attention_backend: Annotated[Literal["auto", "torch", "triton", "cpp"], Meta(description=(
        "decode attention: triton reads the paged KV cache in place with this project's "
        "Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); cpp does the same on the CPU "
        "with its C++ kernel (float32; built on first use, needs a C++ compiler); torch "
        "gathers each sequence's context and runs SDPA; auto: triton on CUDA where Triton is "
        "installed, cpp on a float32 CPU worker where it builds, else torch"))] = "auto"
    async_scheduling: Annotated[bool, Meta(description=(
        "plan a decode step while the one before it runs (before its result), so the workers "
        "start it without waiting for the scheduler; a request that the step before ends "
        "computes one wasted token"))] = True
    overlap_steps: Annotated[Literal["auto", "on", "off"], Meta(description=(
        "workers launch the next step behind the one running, its inputs taking that step's "
        "sampled tokens on the device, before they wait for it and send its result, so the "
        "device does not idle through host work between steps (with --async-scheduling); "
        "auto: on with CUDA workers"))] = "auto"
    quantization: Annotated[Literal["none", "int8"], Meta(description=(
        "none: the weights in --dtype (exact); int8: projection weights quantized per output "
        "channel and activations per token, multiplied as int8 (CPU only; eager, --compile does not "
        "apply; faster, slightly different outputs: see docs/BENCHMARKS.md for its quality)"))] = "none"
    dist_backend: Annotated[Literal["auto", "gloo", "nccl", "hccl"], Meta(description=(
        "torch.distributed backend of the tensor-parallel group: auto picks nccl on CUDA, hccl "
        "where Habana's plugin is installed, gloo otherwise"))] = "auto"
    dist_timeout_s: Annotated[float, Meta(gt=0, description=(
        "seconds a worker waits to join the process group (reach the master) before it "
        "exits with an error"))] = 300.0
    row_parallel_chunks: Annotated[int, Meta(ge=0, description=(
        "split row-parallel layers' input into this many chunks and overlap each chunk's "
        "all-reduce with the next chunk's matmul (TP > 1 only); 0 reads "
        "SPMD_ROW_PARALLEL_CHUNKS, else 1 (off)"))] = 0
    row_parallel_chunk_threshold: Annotated[int, Meta(ge=0, description=(
        "fewest tokens a batch needs for row-parallel chunking; 0 reads "
        "SPMD_ROW_PARALLEL_CHUNK_THRESHOLD, else 8192"))] = 0
    thermal_sensor: Annotated[str, Meta(description=(
        "where each worker reads its device temperature: auto (nvml on CUDA if it "
        "initialises, else psutil, else none), nvml, psutil, file:PATH (a number read from "
        "PATH each time; {rank} expands to the worker's rank) or none"))] = "auto"
    thermal_interval_steps: Annotated[int, Meta(ge=1, description=(
        "read the sensors and all-reduce the group's maximum every this many steps"))] = 1
    thermal_target_c: Annotated[float, Meta(gt=0, description=(
        "hottest-device temperature (Celsius) at which the running batch starts to shrink"))] = 82.0
    thermal_hysteresis_c: Annotated[float, Meta(ge=0, description=(
        "throttling stops only below target minus this many degrees, so a temperature "
        "hovering at the target does not make requests bounce"))] = 3.0
    thermal_kp: Annotated[float, Meta(gt=0, description=(
        "running requests taken off the cap per degree over the target (at least one when "
        "throttling starts)"))] = 1.0
    thermal_policy: Annotated[str, Meta(description=(
        "thermal policy class: empty for the built-in proportional controller, module:Class, "
        "or the name of a spmd_runtime.thermal_policies entry point"))] = ""
    thermal_victims: Annotated[Literal["lru", "largest_kv", "lowest_priority"], Meta(
        description=(
            "which running requests leave when the batch must shrink: lru (the most recently "
            "admitted or resumed, which lose the least progress), largest_kv (those holding "
            "the most KV blocks) or lowest_priority (lowest request priority, then lru)"))] = "lru"
    enable_admin: Annotated[bool, Meta(description=(
        "accept admin calls (batch control: evict, cap, thermal target); with --admin-token "
        "set, only calls carrying it"))] = False
    admin_token: Annotated[str, Meta(description=(
        "secret every admin call must carry; setting it enables admin calls"))] = ""
    allow_remote: Annotated[bool, Meta(description=(
        "allow the RPC address, the HTTP front or the workers' socket to listen on a "
        "non-loopback address; needs --auth-token"))] = False
    auth_token: Annotated[str, Meta(description=(
        "shared secret every client frame (and, across nodes, every worker frame) must carry; "
        "frames without it are refused"))] = ""
    served_model_name: Annotated[str, Meta(description=(
        "name clients use for the model (HTTP `model` field, /v1/models, RPC model info); "
        "empty: the --model value as typed, or the file or directory name for a path"))] = ""
    http_host: Annotated[str, Meta(description=(
        "address the OpenAI-compatible HTTP front binds to"))] = "127.0.0.1"
    http_port: Annotated[int, Meta(ge=0, le=65535, description=(
        "port of the OpenAI-compatible HTTP front started by `spmdrun serve`; 0: no HTTP front"))] = 0
    nproc_per_node: Annotated[int, Meta(ge=1, description="worker processes (devices) per node")] = 1
    nnodes: Annotated[int, Meta(ge=1, description="number of nodes in the job")] = 1
    node_rank: Annotated[int, Meta(ge=0, description="rank of this node (0 runs the scheduler)")] = 0
    master_addr: Annotated[str, Meta(description="address of node 0")] = "127.0.0.1"
    master_port: Annotated[int, Meta(ge=0, le=65535, description=(
        "torch.distributed port on node 0; the scheduler's worker socket uses port + 1; "
        "0 picks a free port (single node only)"))] = 0
    rpc_address: Annotated[str, Meta(description=(
        "ZeroMQ address the scheduler serves clients on (tcp://host:port or ipc://path)"))] = (
        "tcp://127.0.0.1:7760")
    worker_address: Annotated[str, Meta(description=(
        "ZeroMQ address the scheduler and workers talk on; empty picks one"))] = ""
    step_timeout_s: Annotated[float, Meta(gt=0, description=(
        "seconds without a step result before the workers are declared dead"))] = 300.0
    max_restarts: Annotated[int, Meta(ge=0, description=(
        "times per hour the worker group is restarted after a worker dies (single node), its "
        "requests recomputed and completed; 0: a dead worker fails every request and ends "
        "the job"))] = 3
    heartbeat_timeout_s: Annotated[float, Meta(gt=0, description=(
        "workers exit when neither a plan nor a heartbeat (sent every second) came from the "
        "scheduler for this many seconds"))] = 5.0
    max_message_bytes: Annotated[int, Meta(ge=1024, description=(
        "largest client frame the scheduler reads; larger ones get an error reply (and past "
        "4x this, the connection is dropped)"))] = 8 * 2**20
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(description=(
        "least severe log records shown; debug also shows the traceback of a user error"))] = (
        "info")

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_byte_size(self.kv_cache_memory, "--kv-cache-memory")
        sensor = self.thermal_sensor
        if sensor not in THERMAL_SENSORS and not (sensor.startswith("file:") and len(sensor) > 5):
            raise ValueError(f"thermal_sensor must be one of {', '.join(THERMAL_SENSORS)} or "
                             f"file:PATH, got {sensor!r}")
        if self.quantization != "none" and self.device == "cuda":
            raise ValueError(f"--quantization {self.quantization} runs on the CPU's integer GEMM: "
                             "use --device cpu, or --quantization none on CUDA")
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

    @property
    def admin_enabled(self) -> bool:
        return self.enable_admin or bool(self.admin_token)

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
