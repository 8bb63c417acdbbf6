"""torch.distributed set-up from torchrun's environment contract (RANK, WORLD_SIZE, MASTER_ADDR...)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but CUDA is not available; use --device cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if requested not in ("auto", "cpu"):
        raise ValueError(f"unknown device {requested!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def init_distributed(requested_device: str) -> DistributedContext:
    """Join the process group named by the torchrun environment (a group of one without it)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from protocol.transport import free_tcp_port
        os.environ["MASTER_PORT"] = str(free_tcp_port())
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=10))
    return DistributedContext(rank, local_rank, world_size, device, backend)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
