"""The ordered segment iterator (the original ``LMOrderedIterator``), batch-first and resumable.

Legend: N tokens in the stream, B global batch (parallel streams), W world size, L = N // B stream
length, T target length of a segment, C context carried from the previous segment (C <= ext_len).

The stream is trimmed to B * L tokens and cut into B contiguous streams, stream b being
``tokens[b * L:(b + 1) * L]``. A segment starting at position i of every stream covers targets
i+1 .. i+T; its input also carries the C = min(ext_len, i) tokens before i, whose labels are -100
(they are context, not predictions: the loss ignores them). Consecutive segments continue each stream
where the previous one stopped, which is what the recurrence memory of Transformer-XL needs.

With ``var_len`` the target length varies as in the original training script: T = tgt_len with
probability 0.95 else tgt_len / 2, plus normal jitter (std 5), at least 5, at most tgt_len + 3 * 5.
The draws come from a seeded numpy Generator whose state is part of ``state_dict``, so a resumed
iterator yields exactly the batches the uninterrupted one would have.

Distributed: rank r of W takes streams [r * B / W, (r + 1) * B / W). Every rank makes the same
length draws (same seed), so the union of the ranks' batches is the single-process batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from txl.labels import IGNORE_INDEX
from txl.runtime import to_device


@dataclass(frozen=True)
class Batch:
    """One segment of every (local) stream."""

    input_ids: torch.Tensor
    """(B_local, C + T) int64: C context tokens then the T segment tokens."""
    labels: torch.Tensor
    """(B_local, C + T) int64: the next token of each input position; -100 over the C context ones."""
    context_len: int
    """C: leading positions that are carried context (labels -100)."""
    start: int
    """Position i in each stream of the first segment (non-context) token."""

    @property
    def tgt_len(self) -> int:
        return self.input_ids.shape[1] - self.context_len


class OrderedIterator:
    """Iterate ``tokens`` (a 1-D array, e.g. a memory map) as B parallel contiguous streams.

    One ``for batch in it`` runs to the end of the current epoch; iterating again starts the next.
    """

    def __init__(self, tokens: np.ndarray, *, batch_size: int, tgt_len: int, ext_len: int = 0,
                 var_len: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1,
                 device: torch.device | str | None = None, min_len: int = 5, len_std: float = 5.0,
                 max_deviation: float = 3.0) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if batch_size < 1 or tgt_len < 1 or ext_len < 0:
            raise ValueError(f"need batch_size >= 1, tgt_len >= 1, ext_len >= 0; got {batch_size}, "
                             f"{tgt_len}, {ext_len}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        if batch_size % world_size:
            raise ValueError(f"the global batch_size={batch_size} must be divisible by "
                             f"world_size={world_size} so every rank gets the same number of streams; "
                             f"use a multiple of {world_size}")
        self.stream_len = len(tokens) // batch_size  # L
        if self.stream_len < 2:
            raise ValueError(f"{len(tokens)} tokens are too few for batch_size={batch_size}: each stream "
                             "needs at least 2 tokens (an input and its label)")
        self.batch_size, self.tgt_len, self.ext_len = batch_size, tgt_len, ext_len
        self.var_len, self.seed, self.rank, self.world_size = var_len, seed, rank, world_size
        self.device = device
        self.min_len, self.len_std = min_len, len_std
        self.max_len = int(tgt_len + max_deviation * len_std)
        per_rank = batch_size // world_size
        # (B, L) view of the trimmed stream; only this rank's rows are ever read.
        self._streams = tokens[:batch_size * self.stream_len].reshape(batch_size, self.stream_len)
        self._rows = slice(rank * per_rank, (rank + 1) * per_rank)
        self.pos = 0
        self.epoch = 0
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        """Segments per epoch with fixed length (an estimate when ``var_len``)."""
        return -(-(self.stream_len - 1) // self.tgt_len)

    def _next_len(self) -> int:
        if not self.var_len:
            return self.tgt_len
        # Dai et al. 2019 training script: mostly the full length, sometimes half, with jitter.
        base = self.tgt_len if self.rng.random() < 0.95 else self.tgt_len / 2.0
        return int(min(self.max_len, max(self.min_len, int(self.rng.normal(base, self.len_std)))))

    def _batch(self, i: int, seq_len: int) -> Batch:
        seq_len = min(seq_len, self.stream_len - 1 - i)
        beg = max(0, i - self.ext_len)
        rows = self._streams[self._rows]
        # Always copies: the batch must never alias (and -100 must never be written into) the tokens.
        inputs = np.array(rows[:, beg:i + seq_len], dtype=np.int64, copy=True)  # (B_local, C + T)
        labels = np.array(rows[:, beg + 1:i + seq_len + 1], dtype=np.int64, copy=True)  # (B_local, C + T)
        labels[:, :i - beg] = IGNORE_INDEX
        # to_device: to CUDA through pinned memory, without blocking (the next batch is cut meanwhile).
        return Batch(input_ids=to_device(torch.from_numpy(inputs), self.device),
                     labels=to_device(torch.from_numpy(labels), self.device), context_len=i - beg, start=i)

    def __iter__(self) -> Iterator[Batch]:
        while self.pos < self.stream_len - 1:
            batch = self._batch(self.pos, self._next_len())
            # Advance before yielding: a state_dict taken now resumes at the next segment.
            self.pos += batch.tgt_len
            yield batch
        self.pos = 0
        self.epoch += 1

    def tail_counts(self, cutoffs: list[int], chunks: int = 1) -> list[int]:
        """The most labels one model call holds in each tail cluster of an adaptive softmax (tail i: ids cutoffs[i]
        <= id < cutoffs[i + 1], the last up to the vocabulary) over every batch this iterator yields, in any epoch:
        what ``AdaptiveLogSoftmax.fit_capacity`` sizes its 'capacity' rows from, counted once on the host before a
        run. A call is one of world_size x ``chunks`` equal groups of the global batch's streams (a process's share,
        cut into accumulation chunks), so every process gets the same answer; its labels are a segment's targets
        (the carried context's are ignored). With ``var_len`` the segments vary: every window of max_len labels is
        counted, a bound for any segment (at most max_len long)."""
        labels = self._streams[:, 1:]  # (B, L - 1): label column j is stream position j + 1
        groups, width = self.world_size * chunks, min(self.max_len, labels.shape[1])
        at_least = []  # per cutoff c: the labels >= c in each call, (groups, segments or windows)
        for c in cutoffs:
            per_position = (labels >= c).reshape(groups, -1, labels.shape[1]).sum(1, dtype=np.int32)  # (groups, L - 1)
            if self.var_len:  # every window of ``width`` columns, from the running sums
                run = np.pad(per_position.cumsum(1, dtype=np.int64), ((0, 0), (1, 0)))  # (groups, L)
                at_least.append(run[:, width:] - run[:, :-width])  # (groups, L - width)
            else:  # the segments' columns [i, i + T), i = 0, T, 2T, ... (the last one shorter)
                at_least.append(np.add.reduceat(per_position, np.arange(0, labels.shape[1], self.tgt_len), axis=1))
        at_least.append(np.zeros_like(at_least[-1]) if cutoffs else None)
        return [int((at_least[i] - at_least[i + 1]).max()) for i in range(len(cutoffs))]

    def state_dict(self) -> dict[str, Any]:
        """Position, epoch and RNG state: small, JSON-able, enough to resume exactly."""
        return {"pos": self.pos, "epoch": self.epoch, "rng": self.rng.bit_generator.state,
                "batch_size": self.batch_size, "stream_len": self.stream_len, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["batch_size"], state["stream_len"]) != (self.batch_size, self.stream_len):
            raise ValueError(f"iterator state is for batch_size={state['batch_size']} over streams of "
                             f"{state['stream_len']} tokens, but this iterator has "
                             f"batch_size={self.batch_size} and {self.stream_len}; resume with the same data "
                             "and global batch size")
        self.pos, self.epoch = int(state["pos"]), int(state["epoch"])
        self.rng.bit_generator.state = state["rng"]


def eval_iterator(tokens: np.ndarray, *, batch_size: int, tgt_len: int, ext_len: int = 0, rank: int = 0,
                  world_size: int = 1, device: torch.device | str | None = None) -> OrderedIterator:
    """Evaluation order: fixed ``tgt_len``, no length jitter."""
    return OrderedIterator(tokens, batch_size=batch_size, tgt_len=tgt_len, ext_len=ext_len, var_len=False,
                           rank=rank, world_size=world_size, device=device)
