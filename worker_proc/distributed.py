"""torch.distributed set-up from torchrun's environment contract (RANK, WORLD_SIZE, MASTER_ADDR...)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from spmd_runtime.runtime.network import choose_socket_interface

log = logging.getLogger("spmd.worker")


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    # Gloo group beside the device group, for small control collectives on CPU tensors.
    cpu_group: object | None = None


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but CUDA is not available; use --device cpu")
        count = torch.cuda.device_count()
        if local_rank >= count:
            # NCCL refuses two ranks on one device only at the first collective, and obscurely.
            raise ValueError(
                f"local rank {local_rank} needs a CUDA device of its own, but this node shows "
                f"{count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
                f"run at most {count} rank(s) per node (--nproc-per-node), or use --device cpu")
        return torch.device("cuda", local_rank)
    if requested not in ("auto", "cpu"):
        raise ValueError(f"unknown device {requested!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def pick_backend(requested: str, device: torch.device) -> str:
    """auto: nccl on CUDA, hccl where Habana's torch plugin imports (importing it registers
    the backend), gloo otherwise. A named backend must be available in this torch."""
    if requested == "auto":
        if device.type == "cuda":
            return "nccl"
        return "hccl" if _register_hccl() else "gloo"
    if requested == "hccl":
        _register_hccl()
    if requested not in ("gloo", "nccl", "hccl"):
        raise ValueError(f"unknown --dist-backend {requested!r}: use auto, gloo, nccl or hccl")
    if not dist.is_backend_available(requested):
        raise ValueError(f"--dist-backend {requested} is not available in this torch build "
                         f"(torch {torch.__version__}); use gloo, or auto")
    if requested == "nccl" and device.type != "cuda":
        raise ValueError("--dist-backend nccl needs CUDA devices; use gloo on CPU")
    return requested


def _register_hccl() -> bool:
    try:
        import habana_frameworks.torch.distributed.hccl  # noqa: F401
    except ImportError:
        return False
    return True


def init_distributed(requested_device: str, requested_backend: str = "auto",
                     timeout_s: float = 300.0) -> DistributedContext:
    """Join the process group named by the torchrun environment (a group of one without it)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from spmd_runtime.protocol.transport import free_tcp_port
        os.environ["MASTER_PORT"] = str(free_tcp_port())
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = pick_backend(requested_backend, device)
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if world_size > 1:
        log.info("rank %d: %s", rank, choose_socket_interface(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    try:
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as error:
        raise RuntimeError(
            f"rank {rank} could not join the {world_size}-rank process group at {master} "
            f"within {timeout_s:.0f}s ({error}); check that node 0 is running and that "
            "--master-addr / --master-port reach it") from None
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    return DistributedContext(rank, local_rank, world_size, device, backend, cpu_group)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
