"""The options of an engine, one msgspec Struct per domain. Each domain adds its fields to the
one before it, so EngineConfig (protocol/config.py), the last of the chain, is one flat object
(`config.block_size`, flat JSON) and the --help section of a field is the domain declaring it."""
from __future__ import annotations

import typing
from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

# Which running requests leave when the batch must shrink (thermal policy, admin calls).
VictimPolicy = Literal["lru", "largest_kv", "lowest_priority"]
VICTIM_POLICIES: tuple[str, ...] = typing.get_args(VictimPolicy)


class ModelOptions(msgspec.Struct, kw_only=True):
    """What is served and in which number format."""

    section: ClassVar[str] = "model"
    model: Annotated[str, Meta(description=(
        "model to serve: 'smollm2' (embedded), a .gguf file, a Hugging Face directory, "
        "or dummy:<one of those> for random weights"))] = "smollm2"
    dtype: Annotated[Literal["auto", "float32", "float16", "bfloat16"], Meta(description=(
        "weight and activation dtype: auto (bfloat16 on CUDA and on CPUs with AMX or "
        "AVX512-BF16, float32 on other CPUs; the log says which and why), float32 (exact), "
        "float16 or bfloat16"))] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], Meta(description=(
        "auto: cuda where available, else cpu"))] = "auto"
    quantization: Annotated[Literal["auto", "none", "int8", "gguf"], Meta(description=(
        "auto: gguf for a .gguf file whose layers are in the block types gguf keeps, none "
        "otherwise; none: the weights in --dtype (exact); int8: projection weights quantized per output "
        "channel and activations per token, multiplied as int8 (CPU only; eager: "
        "--execution-mode compiled compiles nothing; faster, slightly different outputs: see "
        "docs/BENCHMARKS.md for its quality); gguf: a .gguf file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and "
        "K-quant (Q4_K, Q5_K, Q6_K) projection and embedding weights stay in the file's own "
        "blocks (weight memory = the file's size; 16-bit fixed-point activations and integer "
        "dot products at decode; other types are dequantised, logged; eager; on CUDA each "
        "projection's blocks are expanded by torch operations before its product)"))
    ] = "auto"
    dummy_seed: Annotated[int, Meta(description="seed of the random weights of dummy: models")] = 0


class ParallelOptions(ModelOptions, kw_only=True):
    """How many processes, on which nodes, and how they talk."""

    section: ClassVar[str] = "parallelism & launcher"
    nproc_per_node: Annotated[int, Meta(ge=1, description="worker processes (devices) per node")] = 1
    nnodes: Annotated[int, Meta(ge=1, description="number of nodes in the job")] = 1
    node_rank: Annotated[int, Meta(ge=0, description="rank of this node (0 runs the scheduler)")] = 0
    master_addr: Annotated[str, Meta(description="address of node 0")] = "127.0.0.1"
    master_port: Annotated[int, Meta(ge=0, le=65535, description=(
        "torch.distributed port on node 0; the scheduler's worker socket uses port + 1; "
        "0 picks a free port (single node only)"))] = 0
    worker_address: Annotated[str, Meta(description=(
        "ZeroMQ address the scheduler and workers talk on; empty picks one"))] = ""
    dist_backend: Annotated[Literal["auto", "gloo", "nccl", "hccl"], Meta(description=(
        "torch.distributed backend of the tensor-parallel group: auto picks nccl on CUDA, hccl "
        "where Habana's plugin is installed, gloo otherwise"))] = "auto"
    dist_timeout_s: Annotated[float, Meta(gt=0, description=(
        "seconds a worker waits to join the process group (reach the master) before it "
        "exits with an error"))] = 300.0
    # "auto", or a count (a string of digits from the command line becomes an int).
    row_parallel_chunks: Annotated[Annotated[int, Meta(ge=1)] | str, Meta(
        description=(
            "split row-parallel layers' input into this many chunks and overlap each chunk's "
            "all-reduce with the next chunk's matmul (TP > 1 only); auto: the workers time "
            "the layer on the group's own link at start-up and pick the chunk count and the "
            "threshold (or off) that is fastest; 1: off (where not given: "
            "SPMD_ROW_PARALLEL_CHUNKS, else 1)"))] = 1
    row_parallel_chunk_threshold: Annotated[int, Meta(ge=0, description=(
        "fewest tokens a batch needs for row-parallel chunking (where not given: "
        "SPMD_ROW_PARALLEL_CHUNK_THRESHOLD, else 8192)"))] = 8192


class SchedulingOptions(ParallelOptions, kw_only=True):
    """What runs in a step, and how steps overlap."""

    section: ClassVar[str] = "scheduling & batching"
    scheduler: Annotated[Literal["fifo", "prefill_first"], Meta(description=(
        "fifo: running decodes, then unfinished prefills, then waiting requests in arrival "
        "order; prefill_first: unfinished prefills before decodes"))] = "fifo"
    max_num_seqs: Annotated[int, Meta(ge=1, description="most requests running at once")] = 64
    max_num_batched_tokens: Annotated[int, Meta(ge=0, description=(
        "token budget of one step; longer prompts are prefilled in chunks; 0 (auto): 4096 on "
        "CPU workers, 1024 on CUDA"))] = 0
    max_model_len: Annotated[int, Meta(ge=0, description=(
        "longest prompt + output in tokens; 0 uses the model's context length"))] = 0
    step_pipelining: Annotated[Literal["auto", "off", "schedule_ahead", "overlap"], Meta(
        description=(
            "how steps overlap. off: the scheduler plans a step once the one before has "
            "returned; schedule_ahead: it plans a decode step while the one before runs, so the "
            "workers start it without waiting for the scheduler (a request that the step "
            "before ends computes one wasted token); overlap: schedule_ahead, and the workers "
            "launch that step behind the running one, its inputs taking that step's sampled "
            "tokens on the device, so the device does not idle through host work between "
            "steps; auto: overlap with CUDA workers, schedule_ahead on CPU"))] = "auto"
    speculative: Annotated[Literal["off", "ngram", "draft"], Meta(description=(
        "speculative decoding. ngram: each decoding request's last tokens are looked up in its "
        "prompt and output (prompt lookup), and the tokens that followed them there are "
        "proposed; draft: --draft-model proposes them, greedily, on every worker; one step "
        "verifies them all, keeping the outputs exactly those of decoding token by token "
        "(greedy) or their distribution (sampled). With a draft model, requests with a "
        "structured output decode as usual. With buckets (bucketed, compiled), a step small "
        "enough to speculate runs unpadded and eagerly; larger ones keep their buckets and "
        "graphs"))] = "off"
    draft_model: Annotated[str, Meta(description=(
        "--speculative draft: the model that proposes (any --model form; the same vocabulary "
        "as --model), whole on every worker, its KV cache in the same blocks"))] = ""
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=64, description=(
        "most tokens proposed per request and step"))] = 4
    prompt_lookup_min: Annotated[int, Meta(ge=1, description=(
        "ngram: shortest suffix looked up"))] = 2
    prompt_lookup_max: Annotated[int, Meta(ge=1, description=(
        "ngram: longest suffix looked up (longer matches are tried first)"))] = 4
    speculative_disable_by_batch_size: Annotated[int, Meta(ge=1, description=(
        "no proposals in a step where more requests than this run: verifying costs compute "
        "that a large batch no longer has to spare"))] = 4


class CacheOptions(SchedulingOptions, kw_only=True):
    """The KV cache: its block size, its size, its swap space and prefix reuse. Its size is
    decided by the first of: --num-kv-blocks (an exact count), --kv-cache-memory (bytes), else
    memory: on CUDA --gpu-memory-utilization of the free memory, on CPU a default."""

    section: ClassVar[str] = "KV cache & memory"
    block_size: Annotated[int, Meta(ge=1, description="tokens per KV-cache block")] = 16
    num_kv_blocks: Annotated[int, Meta(ge=0, description=(
        "KV-cache blocks per worker, an exact count that overrides memory sizing (it wins over "
        "--kv-cache-memory and --gpu-memory-utilization); 0 sizes the pool from memory"))] = 0
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1, description=(
        "on CUDA, share of the memory left free after loading the weights and a profiling "
        "forward pass that activations, graphs and KV cache may use; sizes the KV cache only "
        "when neither --num-kv-blocks nor --kv-cache-memory is set"))] = 0.9
    # A size with a unit ("4GiB") on the command line or in JSON; an int of bytes once built.
    kv_cache_memory: Annotated[Annotated[int, Meta(ge=0)] | str, Meta(description=(
        "KV cache per worker, set outright (overrides --gpu-memory-utilization; --num-kv-blocks "
        "overrides it): bytes, or a size such as 512MiB, 4GiB, 2G or 1.5GB; 0: on CUDA sized "
        "from free memory, on CPU 2GiB, or a quarter of the available RAM shared by the "
        "node's workers if smaller"))] = 0
    kv_swap_memory: Annotated[Annotated[int, Meta(ge=0)] | str, Meta(description=(
        "CPU memory per worker that preempted requests' KV blocks are offloaded to (pinned on "
        "CUDA): bytes, or a size such as 512MiB or 1GiB; 0 preempts by soft reset (recompute) "
        "only"))] = 0
    kv_admission_watermark: Annotated[float, Meta(ge=0, lt=1, description=(
        "share of KV blocks kept spare when admitting a request (or resuming a swapped one) "
        "while others run, so running requests can grow without preemption"))] = 0.2
    enable_prefix_caching: Annotated[bool, Meta(description=(
        "reuse the KV cache of shared prompt prefixes across requests"))] = True
    kv_cache_huge_pages: Annotated[bool, Meta(description=(
        "on a CPU worker under Linux, ask for transparent huge pages (2 MiB) for the KV cache, "
        "where the kernel's transparent_hugepage setting is madvise or always: a decode step "
        "reads blocks scattered over the pool, which on 4 KiB pages miss the TLB block after "
        "block (W2 with --quantization int8: 1.08-1.11x the tokens a second, docs/BENCHMARKS.md)"))] = True


class ExecutionOptions(CacheOptions, kw_only=True):
    """How a step runs on the device: attention kernel, eager or bucketed, compiled or captured."""

    section: ClassVar[str] = "execution: eager, buckets, compilation, graphs"
    attention_backend: Annotated[Literal["auto", "torch", "triton", "cpp"], Meta(description=(
        "the worker's attention backend, chosen once: triton reads the paged KV cache in place "
        "with this project's Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); cpp is "
        "this project's C++ CPU library (float32 or bfloat16: KV write, decode and prompt "
        "attention, fused layer passes; built ahead by `make env` / `spmdrun build-kernels`); "
        "torch gathers each sequence's context and runs SDPA; auto: triton on CUDA where Triton "
        "is installed, cpp on a CPU worker (an error naming the build command where it is not "
        "built), else torch"))] = "auto"
    execution_mode: Annotated[Literal["auto", "eager", "bucketed", "compiled"], Meta(
        description=(
            "how a step runs. eager: every batch in its own shape, nothing compiled or "
            "captured; bucketed: every batch padded to one of a few (batch size, length) "
            "buckets, warmed up before serving (a step is then either a prompt step or a "
            "decode step); compiled: bucketed, and on CPU the dense layer pieces compiled with "
            "torch.compile(dynamic=False) per bucket (not with --quantization int8, which runs "
            "eagerly), on CUDA graphs captured of the buckets; auto: compiled on CUDA, eager on "
            "CPU"))] = "auto"
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
        "for compilation, and no CUDA graphs are captured, as capture is part of warmup); "
        "on a CPU without buckets, without the one short prompt that warms the kernels up"))
    ] = False
    graph_reserved_mem: Annotated[float, Meta(ge=0, lt=1, description=(
        "with --execution-mode compiled on CUDA, share of the usable memory set aside for "
        "captured graphs before the KV cache is sized; must be above 0 (for no graphs, use "
        "--execution-mode bucketed or eager)"))] = 0.1
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


class ThermalOptions(ExecutionOptions, kw_only=True):
    """Throttling the batch when the devices run hot."""

    section: ClassVar[str] = "thermal"
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
    thermal_victims: Annotated[VictimPolicy, Meta(description=(
        "which running requests leave when the batch must shrink: lru (the most recently "
        "admitted or resumed, which lose the least progress), largest_kv (those holding the "
        "most KV blocks) or lowest_priority (lowest request priority, then lru)"))] = "lru"


class FaultOptions(ThermalOptions, kw_only=True):
    """Detecting and recovering from dead workers."""

    section: ClassVar[str] = "fault tolerance"
    step_timeout_s: Annotated[float, Meta(gt=0, description=(
        "seconds without a step result before the workers are declared dead"))] = 300.0
    heartbeat_timeout_s: Annotated[float, Meta(gt=0, description=(
        "workers exit when neither a plan nor a heartbeat (sent every second) came from the "
        "scheduler for this many seconds; across nodes, a node or worker silent this long "
        "(killed, cut off, frozen) makes the whole group restart"))] = 5.0
    max_restarts: Annotated[int, Meta(ge=0, description=(
        "times per hour the worker group is restarted after a worker dies (on every node of a "
        "multi-node job), its requests recomputed and completed; 0: a dead worker fails every "
        "request and ends the job"))] = 3
    rejoin_timeout_s: Annotated[float, Meta(gt=0, description=(
        "multi-node: seconds node 0 waits for a node that went away (or never came) to join "
        "again, restarted by hand or by its supervisor, before every request fails and the "
        "job ends"))] = 120.0


class ServingOptions(FaultOptions, kw_only=True):
    """Where clients reach the engine."""

    section: ClassVar[str] = "serving & network"
    served_model_name: Annotated[str, Meta(description=(
        "name clients use for the model (HTTP `model` field, /v1/models, RPC model info); "
        "empty: the --model value as typed, or the file or directory name for a path"))] = ""
    rpc_address: Annotated[str, Meta(description=(
        "ZeroMQ address the scheduler serves clients on (tcp://host:port or ipc://path)"))] = (
        "tcp://127.0.0.1:7760")
    http_host: Annotated[str, Meta(description=(
        "address the OpenAI-compatible HTTP front binds to"))] = "127.0.0.1"
    http_port: Annotated[int, Meta(ge=0, le=65535, description=(
        "port of the OpenAI-compatible HTTP front started by `spmdrun serve`; 0: no HTTP front"))] = 0
    max_message_bytes: Annotated[int, Meta(ge=1024, description=(
        "largest client frame the scheduler reads; larger ones get an error reply (and past "
        "4x this, the connection is dropped)"))] = 8 * 2**20
    tool_call_parser: Annotated[Literal["none", "hermes", "llama3_json", "mistral"], Meta(description=(
        "how the HTTP front reads tool calls out of a chat completion with tools and tool_choice "
        "auto: hermes (Hermes, Qwen), llama3_json (Llama 3.x), mistral; none: tool_choice auto "
        "is refused (required and a named function need none)"))] = "none"


class SecurityOptions(ServingOptions, kw_only=True):
    """Who may connect, and who may run admin calls."""

    section: ClassVar[str] = "security"
    allow_remote: Annotated[bool, Meta(description=(
        "allow the RPC address, the HTTP front or the workers' socket to listen on a "
        "non-loopback address; needs --auth-token"))] = False
    auth_token: Annotated[str, Meta(description=(
        "shared secret every client frame (and, across nodes, every worker frame) must carry; "
        "frames without it are refused"))] = ""
    enable_admin: Annotated[bool, Meta(description=(
        "accept admin calls (batch control: evict, cap, thermal target); the one switch for "
        "them: with --admin-token set, only calls carrying it are accepted"))] = False
    admin_token: Annotated[str, Meta(description=(
        "secret every admin call must carry (needs --enable-admin; the HTTP front's admin "
        "route needs one); also read from SPMD_ADMIN_TOKEN"))] = ""
    curve_keys: Annotated[str, Meta(description=(
        "encrypt every engine socket that listens beyond loopback (client RPC, scheduler <-> "
        "workers) with ZeroMQ CURVE: the directory `spmdrun keys DIR` made (node 0 needs its "
        "secret key; other nodes may be given only DIR/job.key); clients then need the public "
        "key, DIR/job.key; torch.distributed's own traffic is not encrypted"))] = ""


class LoggingOptions(SecurityOptions, kw_only=True):
    """What the processes log."""

    section: ClassVar[str] = "logging"
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(description=(
        "least severe log records shown; debug also shows the traceback of a user error"))] = (
        "info")



DOMAINS: tuple[type[msgspec.Struct], ...] = (
    ModelOptions, ParallelOptions, SchedulingOptions, CacheOptions, ExecutionOptions,
    ThermalOptions, FaultOptions, ServingOptions, SecurityOptions, LoggingOptions)


def option_sections() -> dict[str, tuple[str, ...]]:
    """The --help section title of each domain and the fields it declares, in order."""
    return {domain.section: tuple(name for name in domain.__struct_fields__
                                  if name in domain.__annotations__)
            for domain in DOMAINS}
