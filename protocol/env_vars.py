"""Every environment variable the project reads or sets, in one registry: its name, what it
means and who reads it. docs/CONFIGURATION.md lists them (tests/protocol/test_env_vars.py keeps
both in step with the source)."""
from __future__ import annotations

from dataclasses import dataclass

from spmd_runtime.protocol.step_shape import Phase


@dataclass(frozen=True)
class EnvVar:
    name: str
    meaning: str
    read_by: str


SPMD_ENGINE_CONFIG = "SPMD_ENGINE_CONFIG"
SPMD_WORKER_GENERATION = "SPMD_WORKER_GENERATION"
SPMD_API_KEY = "SPMD_API_KEY"
SPMD_ADMIN_TOKEN = "SPMD_ADMIN_TOKEN"
SPMD_ROW_PARALLEL_CHUNKS = "SPMD_ROW_PARALLEL_CHUNKS"
SPMD_ROW_PARALLEL_CHUNK_THRESHOLD = "SPMD_ROW_PARALLEL_CHUNK_THRESHOLD"


def bucket_variable(phase: Phase, dimension: str, part: str) -> str:
    """SPMD_{PROMPT,DECODE}_{BS,SEQ}_BUCKET_{MIN,STEP,MAX}: one end or step of a bucket range."""
    return f"SPMD_{phase.upper()}_{dimension.upper()}_BUCKET_{part.upper()}"


BUCKET_PARTS = ("min", "step", "max")
BUCKET_VARIABLES = tuple(bucket_variable(phase, dimension, part)
                         for phase in Phase for dimension in ("bs", "seq")
                         for part in BUCKET_PARTS)

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(SPMD_ENGINE_CONFIG, "the EngineConfig JSON handed to a child process (the "
           "environment is private to its owner, argv is not); popped once read",
           "launch/__main__.py, protocol/process_entry.py"),
    EnvVar(SPMD_WORKER_GENERATION, "how many times the worker group was restarted; set by the "
           "launcher for each worker", "worker_proc/worker.py"),
    EnvVar(SPMD_API_KEY, "--auth-token when the flag is not given", "launch/options.py"),
    EnvVar(SPMD_ADMIN_TOKEN, "--admin-token when the flag is not given (with --enable-admin)",
           "launch/options.py"),
    EnvVar(SPMD_ROW_PARALLEL_CHUNKS, "--row-parallel-chunks when it is not given (default 1: "
           "off)",
           "protocol/config_resolve.py (where the config is made: the command line, LLM)"),
    EnvVar(SPMD_ROW_PARALLEL_CHUNK_THRESHOLD, "--row-parallel-chunk-threshold when it is not "
           "given (default 8192)",
           "protocol/config_resolve.py (where the config is made: the command line, LLM)"),
    *(EnvVar(name, "one part (min, step or max) of a bucket range whose option "
             f"(--{name.split('_')[1].lower()}-{name.split('_')[2].lower()}-bucket) is empty",
             "protocol/config_resolve.py (where the config is made: the command line, LLM)")
      for name in BUCKET_VARIABLES),
    EnvVar("RANK", "this worker's global rank (torchrun or the launcher)",
           "worker_proc/distributed.py, worker_proc/worker.py"),
    EnvVar("LOCAL_RANK", "this worker's rank on its node", "worker_proc/distributed.py"),
    EnvVar("WORLD_SIZE", "workers in the job", "worker_proc/distributed.py"),
    EnvVar("LOCAL_WORLD_SIZE", "workers on this node (CPU threads and CPU KV cache are shared "
           "among them)", "worker_proc/worker.py"),
    EnvVar("MASTER_ADDR", "torch.distributed rendezvous host", "worker_proc/distributed.py"),
    EnvVar("MASTER_PORT", "torch.distributed rendezvous port", "worker_proc/distributed.py"),
    *(EnvVar(name, "network interface of the collectives; where unset and the master is not "
             "this host, set to the interface that reaches the master",
             "runtime/network.py (workers)") for name in ("GLOO_SOCKET_IFNAME",
                                                          "NCCL_SOCKET_IFNAME")),
    EnvVar("LD_PRELOAD", "set by the launcher for CPU workers: tcmalloc appended where the "
           "machine has it (glibc's allocator faults a step's activations in anew)",
           "launch/engine.py (allocator_preload)"),
    EnvVar("TRITON_INTERPRET", "1 runs the Triton attention kernel on the CPU (interpreter)",
           "runtime/layers/triton_attention.py"),
    EnvVar("XDG_CACHE_HOME", "where downloaded tokenizers are cached (default ~/.cache)",
           "scheduler_proc/tokenizer.py"),
)


def env_vars_table() -> str:
    """The registry as a Markdown table (docs/CONFIGURATION.md)."""
    rows = ["| Variable | Meaning | Read by |", "|---|---|---|"]
    rows += [f"| `{var.name}` | {var.meaning} | {var.read_by} |" for var in ENV_VARS]
    return "\n".join(rows) + "\n"
