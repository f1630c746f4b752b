"""Process-group setup for `torchrun`: gloo on CPU, NCCL on GPU. One process per device."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0, *, flag: str = "--device") -> torch.device:
    """The torch device ``name`` names ('auto': CUDA when available), checked to exist here; ``flag`` is
    the option that set it, for the message."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:  # torch: "Invalid device string"
        raise ValueError(f"{flag} {name!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {name!r}: CUDA is not available on this machine; use {flag} cpu")
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                             f"use {flag} cuda:0")
        return torch.device("cuda", index)
    if device.type not in ("cpu", "mps", "xpu"):
        raise ValueError(f"{flag} {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} {name!r}: MPS is not available on this machine; use {flag} cpu")
    return device


def init_distributed(device: str) -> DistInfo:
    """Join the process group that torchrun describes in RANK/WORLD_SIZE/LOCAL_RANK (read now, not at
    import); a single process when they are absent."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank, flag="--train.device")
    if world_size > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return DistInfo(rank=rank, world_size=world_size, device=dev)


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum a few float64 numbers over all processes (identity in a single process)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_min(values: list[float], info: DistInfo) -> list[float]:
    """Element-wise minimum of a few float64 numbers over all processes (identity in a single process)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


class OtherRankFailed(RuntimeError):
    """Another process of the run failed and said why; this one stops without repeating it."""


def any_true(flag: bool, info: DistInfo) -> bool:
    """Whether ``flag`` holds on any process (so that every process takes the same branch)."""
    if not info.enabled:
        return flag
    return all_reduce_sum([float(flag)], info)[0] > 0

