"""Process-group setup for `torchrun`: gloo on CPU, NCCL on GPU. One process per device."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    peers: tuple[tuple[str, int], ...] = ()
    """(host, pid) of every rank, in rank order (process groups only): which one died, when one does."""

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


def _restart_store(world_size: int) -> dist.Store | None:
    """The store of a torchrun restart: torchrun's own, under a prefix of its own.

    torchrun's workers share the agent's rendezvous TCPStore, and it outlives a restart: keys the dead
    attempt wrote (gloo's and NCCL's peer addresses) are still there, and a restarted rank that reads one
    before its peer rewrote it connects to a process that is gone ("Connection refused", pytorch/pytorch
    #135712). Each attempt's keys under ``txl/attempt_N`` cannot be read by another. None (torch's
    env:// default) outside a restart, or where the workers do not use the agent's store.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=default_pg_timeout)
    return dist.PrefixStore(f"txl/attempt_{restart}", store)


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
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=_restart_store(world_size))
    peers: list = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    return DistInfo(rank=rank, world_size=world_size, device=dev, peers=tuple(peers) if world_size > 1 else ())


class PeerDied(RuntimeError):
    """A collective failed because another process of the run is gone; the message names it."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is running (a killed child not yet reaped is a zombie: not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


def dead_peers(info: DistInfo) -> str:
    """Which other ranks are gone, in words: those of this host whose process ended, or, when every one
    here still runs, the ranks on other hosts (which this process cannot see)."""
    host = socket.gethostname()
    here = [r for r, (h, _) in enumerate(info.peers) if h == host and r != info.rank]
    dead: list[int] = []
    for _ in range(50):  # a killed process closes its sockets just before it is gone: allow it half a second
        dead = [r for r in here if not _alive(info.peers[r][1])]
        if dead or not here:
            break
        time.sleep(0.01)
    if dead:
        return ", ".join(f"rank {r} (pid {info.peers[r][1]})" for r in dead)
    away = [r for r, (h, _) in enumerate(info.peers) if h != host]
    return f"a rank on another host (ranks {away[0]}-{away[-1]})" if away else "another rank"


def is_peer_failure(err: BaseException) -> bool:
    """Whether a collective failed because another process is gone (gloo's and NCCL's words)."""
    text = str(err)
    return type(err).__name__ == "DistBackendError" or "closed by peer" in text or "reset by peer" in text \
        or "Connection closed" in text


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum a few float64 numbers over all processes (identity in a single process)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_sum_tensor(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor over all processes on the device, without reading it back (identity in a single process)."""
    if info.enabled:
        dist.all_reduce(t)
    return t


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
    """Destroy the process group. The run's garbage (the wrapped or sharded model, its DTensors and device mesh,
    which hold the group) is collected first, so the group's C++ objects go now, in an interpreter still whole,
    not in its teardown, where gloo's could abort the finished process (benchmarks/README.md)."""
    if info.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


class OtherRankFailed(RuntimeError):
    """Another process of the run failed and said why; this one stops without repeating it."""


def any_true(flag: bool, info: DistInfo) -> bool:
    """Whether ``flag`` holds on any process (so that every process takes the same branch)."""
    if not info.enabled:
        return flag
    return all_reduce_sum([float(flag)], info)[0] > 0



@contextlib.contextmanager
def naming_dead_peers(info: DistInfo) -> Iterator[None]:
    """Turn a collective's failure because another process died into ``PeerDied`` naming that rank (one
    line for the user instead of gloo's or NCCL's words)."""
    try:
        yield
    except RuntimeError as err:
        if info.enabled and not isinstance(err, PeerDied) and is_peer_failure(err):
            raise PeerDied(f"{dead_peers(info)} of this distributed run died") from err
        raise
