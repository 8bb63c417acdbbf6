"""Start the engine's processes for this node: the scheduler on node 0, one worker per device."""
from __future__ import annotations

import ctypes.util
import logging
import os
import subprocess

import msgspec
from spmd_runtime.launch.supervisor import Supervisor, spawn_python
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.env_vars import SPMD_WORKER_GENERATION
from spmd_runtime.protocol.process_entry import config_env
from spmd_runtime.protocol.transport import free_tcp_port, private_ipc_address
from spmd_runtime.runtime.preflight import resolved_quantization

log = logging.getLogger("spmd.launch")


def complete_addresses(config: EngineConfig) -> EngineConfig:
    """Fill in the ports and addresses left to pick, identically on every node."""
    changes = {}
    master_port = config.master_port
    if not master_port:
        if config.nnodes > 1:
            raise ValueError("--master-port is required when --nnodes > 1")
        master_port = free_tcp_port(config.master_addr)
        changes["master_port"] = master_port
    if not config.worker_address:
        changes["worker_address"] = (
            f"tcp://{config.master_addr}:{master_port + 1}" if config.nnodes > 1
            else private_ipc_address("workers"))
    return msgspec.structs.replace(config, **changes) if changes else config


def start_engine(config: EngineConfig, supervisor: Supervisor) -> EngineConfig:
    """Spawn this node's processes under `supervisor`; returns the completed config."""
    config, why = resolved_quantization(complete_addresses(config))
    log.info("quantization %s (%s)", config.quantization, why)
    if config.node_rank == 0:
        supervisor.add("scheduler", spawn_child("spmd_runtime.scheduler_proc", config))
    if config.node_rank == 0 or config.nnodes == 1:
        start_workers(config, supervisor)
    # Other nodes start theirs when node 0 says which generation (launch/node_agent.py): a node
    # that joins late, or replaces one, then meets the group where it is.
    return config


def start_workers(config: EngineConfig, supervisor: Supervisor, generation: int = 0,
                  master_port: int | None = None) -> None:
    """This node's workers, torchrun's environment contract for each; a restarted group
    (generation > 0) meets on a fresh master port."""
    for local_rank in range(config.nproc_per_node):
        rank = config.node_rank * config.nproc_per_node + local_rank
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(config.world_size), "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "GROUP_RANK": str(config.node_rank),
            "MASTER_ADDR": config.master_addr,
            "MASTER_PORT": str(master_port or config.master_port),
            SPMD_WORKER_GENERATION: str(generation),
            **allocator_preload(config.device),
        }
        supervisor.add(f"worker rank {rank}", spawn_child("spmd_runtime.worker_proc", config, env))


def spawn_child(module: str, config: EngineConfig, env: dict[str, str] | None = None
                ) -> subprocess.Popen:
    """`python -m module` with the config in its environment (not in its argv, which `ps`
    shows every user: the config carries the tokens) and its stderr relayed by the
    supervisor."""
    return spawn_python(module, [], {**config_env(config), **(env or {})},
                        stderr=subprocess.PIPE)


def allocator_preload(device: str) -> dict[str, str]:
    """LD_PRELOAD of tcmalloc for CPU workers, where the machine has it (Debian's
    libtcmalloc-minimal4; `make env` installs it). A CPU worker's activations are blocks of a
    few MB freed and taken again every layer; glibc gives such blocks back to the kernel and
    faults them in anew (1.4 million page faults in a dozen SmolLM2 prefill steps), tcmalloc
    keeps them: a 1,024-token prefill step took 745 ms instead of 790-930 on the 2-core VM.
    vLLM's CPU backend asks for the same preload."""
    if device == "cuda":
        return {}
    library = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if library is None:
        return {}
    preload = os.environ.get("LD_PRELOAD", "")
    if library in preload.split():
        return {}
    log.debug("CPU workers preload %s", library)
    return {"LD_PRELOAD": f"{preload} {library}".strip()}
