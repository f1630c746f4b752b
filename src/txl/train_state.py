"""The training state besides weights and optimiser: small, complete, and a stateful part of the checkpoint.

Resuming must reproduce the uninterrupted run bit for bit, so everything the next step depends on is
here: the step and token counters, the schedule's horizon, the best validation loss so far, the data
iterator's position, and, per process, the random number generators and the memory of each
accumulation chunk (Dai et al. 2019, section 3.2: the memory is state, not a cache).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from txl.data import OrderedIterator
from txl.model import Memory


def rng_state(device: torch.device) -> dict[str, Any]:
    """The process's torch, numpy, Python (and CUDA) generator states, as tensors and numbers only (so
    ``torch.load(weights_only=True)`` reads them)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos,
                                                       has_gauss, gauss], "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def reshard_ranks(ranks: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The per-process parts of a checkpoint written by ``len(ranks)`` processes, for ``world_size`` of them.

    Process r of W reads streams [r B / W, (r + 1) B / W) (txl.data.iterator), chunk a of its A accumulation
    chunks the a-th slice of those: in rank-then-chunk order the memories are the global batch's, so they
    are concatenated along the batch and split again, and every stream keeps its own memory. RNG states
    cannot be split: process r takes old process r mod W_old's (dropout masks then differ from a run that
    never changed its process count; with dropout 0 nothing random is left).
    """
    grad_accum = len(ranks[0]["memories"])
    chunks = [m for r in ranks for m in r["memories"]]  # rank-major, then accumulation chunk
    pieces = world_size * grad_accum
    if any(m is None for m in chunks):  # the start of an epoch: nothing is remembered anywhere
        memories: list[Any] = [None] * pieces
    else:
        per_layer = [torch.cat([m[l] for m in chunks]) for l in range(len(chunks[0]))]  # L x (B, M, d)
        if per_layer[0].size(0) % pieces:
            raise ValueError(f"the checkpoint's {per_layer[0].size(0)} streams do not split over {world_size} "
                             f"process(es) x grad_accum={grad_accum}; use a process count that divides them")
        split = [t.chunk(pieces) for t in per_layer]  # L x pieces x (B / pieces, M, d)
        memories = [tuple(layer[i] for layer in split) for i in range(pieces)]
    return [{"rng": ranks[r % len(ranks)]["rng"], "memories": memories[r * grad_accum:(r + 1) * grad_accum]}
            for r in range(world_size)]


@dataclass
class TrainState:
    """Counters, schedule, iterator position and this process's RNG states and memories.

    ``state_dict()`` returns the process-independent fields plus ``"local"``: this process's RNG states
    and memories. The trainer gathers every process's ``"local"`` into ``"ranks"`` (rank order) before
    saving, and ``load_state_dict(state, rank=r, world_size=W)`` takes back process r's.
    """

    iterator: OrderedIterator
    device: torch.device
    grad_accum: int = 1
    step: int = 0
    tokens: int = 0
    best_valid: float = math.inf
    """The lowest validation loss of a best-checkpoint decision so far (always on the same tokens)."""
    horizon: int = 0
    """The step the schedule decays to when a time budget ends the run before max_steps (0: max_steps).
    Calibrated from the measured step rate and saved, so a resumed run keeps the same schedule."""
    memories: list[Memory | None] = field(default_factory=list)
    """One memory per accumulation chunk of this process's streams."""

    def __post_init__(self) -> None:
        if not self.memories:
            self.memories = [None] * self.grad_accum

    def reset_memories(self) -> None:
        """A new epoch: every stream restarts, there is nothing to remember."""
        self.memories = [None] * self.grad_accum

    def local_state(self) -> dict[str, Any]:
        cpu = [None if m is None else tuple(t.cpu() for t in m) for m in self.memories]
        return {"rng": rng_state(self.device), "memories": cpu}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "best_valid": self.best_valid, "horizon": self.horizon,
                "iterator": self.iterator.state_dict(), "local": self.local_state()}

    def load_state_dict(self, state: dict[str, Any], *, rank: int = 0, world_size: int = 1) -> None:
        ranks = state["ranks"] if "ranks" in state else [state["local"]]
        if len(ranks) != world_size:
            ranks = reshard_ranks(ranks, world_size)
        local = ranks[rank]
        if len(local["memories"]) != self.grad_accum:
            raise ValueError(f"the checkpoint was trained with grad_accum={len(local['memories'])}; resume with "
                             "the same value (each accumulation chunk's memory is part of the state)")
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.best_valid, self.horizon = float(state["best_valid"]), int(state["horizon"])
        self.iterator.load_state_dict(state["iterator"])
        self.memories = [None if m is None else tuple(x.to(self.device) for x in m) for m in local["memories"]]
        set_rng_state(local["rng"], self.device)
