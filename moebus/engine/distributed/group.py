"""Process-group setup for expert parallelism: gloo on CPU, NCCL on GPU, same calling code.

`init_ep_group` wraps `torch.distributed.init_process_group` and returns an `EPGroup` handle
(rank, size, backend, the device collectives run on); nothing is kept in module globals, so
callers pass the handle to the EP layers and engines that need it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class EPGroup:
    rank: int
    world_size: int
    backend: str
    device: torch.device  # where activations exchanged by all-to-all live
    group: dist.ProcessGroup | None = None  # None: the default (world) group

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def resolve_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    return backend


def init_ep_group(world_size: int, rank: int, backend: str = "auto", init_method: str | None = None,
                  timeout_s: float = 300.0) -> EPGroup:
    """Join (creating if needed) the world process group; `init_method` defaults to `env://`
    (MASTER_ADDR / MASTER_PORT). On NCCL each rank takes GPU `LOCAL_RANK` (default: rank)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of [0, {world_size})")
    backend = resolve_backend(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)  # NCCL p2p (EPLB weight moves) hangs without it
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise RuntimeError(f"process group already initialised as rank {dist.get_rank()}/{dist.get_world_size()}")
    return EPGroup(rank, world_size, backend, device)


def init_ep_group_from_env(backend: str = "auto") -> EPGroup:
    """torchrun-style: RANK and WORLD_SIZE (plus MASTER_ADDR / MASTER_PORT) from the environment."""
    return init_ep_group(int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), backend)


def destroy_ep_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
