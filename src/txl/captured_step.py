"""A decode step over static buffers, captured once per batch size as a CUDA graph and replayed.

Shape legend: B rows of a bucket (a batch size the step is captured for), C a buffer's capacity (its columns), L
layers, d d_model, H heads, D head width, N rows of the positional table, V vocabulary.

Why: on a GPU a (B, 1) step of a small model is host time (issue 47: 4.4 ms a token on an H200 for a 4-layer
model, the device idle between ~300 kernel launches). A CUDA graph replays the step's kernels in one launch, but only
at the shapes and addresses it was captured with, and with no host decision inside. So here every step of a bucket
is the same: each layer's memory, keys and values live in a ring of C columns per row (preallocated, never moved),
the step writes the new token's column at ``col`` (a device scalar the step advances) and reads all C columns, a key
hidden unless its distance from the query, ``(col - j) mod C``, is at most the rows its row has read (``lens``, a
device vector the step advances). Rows of different lengths, rows joining and leaving, and slots no row holds are
only different values of ``lens``: the same graph. Relative attention depends on distances alone (Dai et al. 2019,
section 3.3), so where a key lies in the ring changes nothing: key j reads W_kR R at its distance from the table.

The step also takes each row's greedy token (its argmax) in the graph; temperature, top-k/p, penalties and per-row
seeds are drawn after the replay, on the device (``txl.serve.runner.draw``), since a row's own ``torch.Generator``
is not part of the graph.

On a CPU there are no CUDA graphs: ``StepGraphs`` then calls the step function (compiled or not) as it would be
captured, which is how the tests check the capture's discipline without a GPU (one graph per bucket, the buffers'
addresses unchanged, no host sync inside a step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from txl.model.positions import Positions

__all__ = ["BUCKETS", "StepGraphs", "bucket_for", "ring_step"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""The batch sizes a step is captured for (as vLLM captures): a batch runs in the smallest that holds its rows."""


def bucket_for(rows: int) -> int:
    """The smallest bucket of at least ``rows`` rows."""
    for b in BUCKETS:
        if b >= rows:
            return b
    raise ValueError(f"{rows} rows step together, more than the largest bucket ({BUCKETS[-1]}): lower max_batch")


def ring_step(model, ids: torch.Tensor, memory: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
              values: Sequence[torch.Tensor], table: Sequence[torch.Tensor], lens: torch.Tensor, col: torch.Tensor,
              window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one token per row, (B, 1) ``ids``, writing its column ``col`` of every ring; (B, V) float32 log-probs of
    the next token and (B,) each row's most likely one. Advances ``lens`` (capped at ``window``, a sliding window's
    mem_len) and ``col`` (mod C) in place: the next step's.

    memory: L x (B, C, d) each layer's inputs; keys, values: L x (B, C, H, D); table: L x (N, H, D), W_kR R farthest
    first (row N-1-n: distance n; a farther key reads row 0, as a clamped distance does); lens: (B,) int64, the rows
    each row has read (its keys at distances 1 .. lens[b] behind ``col``); col: (1,) int64. Everything a device
    tensor, nothing read back: the step is one graph whatever the values. Eval mode, no autograd: the caller's.
    """
    C, N = keys[0].size(1), table[0].size(0)
    j = torch.arange(C, device=ids.device)  # (C,) column
    dist = (col - j) % C  # (C,): each column's distance behind the query's column
    mask = (dist[None, :] > lens[:, None])[:, None, None, :]  # (B, 1, T=1, C): not read by the row (or never written)
    rows = N - 1 - dist.clamp(max=N - 1)  # (C,): each column's row of the table
    h = model.embed(ids)  # (B, 1, d); eval: no dropout
    u, v = getattr(model, "u", None), getattr(model, "v", None)  # None: each layer's own (untie_r)
    for l, layer in enumerate(model.layers):
        memory[l].index_copy_(1, col, h.to(memory[l].dtype))  # the memory keeps each layer's input
        k, val = layer.attn.keys_values(h)  # (B, 1, H, D) each
        keys[l].index_copy_(1, col, k.to(keys[l].dtype))
        values[l].index_copy_(1, col, val.to(values[l].dtype))
        pos = Positions(projected=table[l].index_select(0, rows))  # (C, H, D): W_kR R at each column's distance
        h = layer(h, None, mask, pos, u, v, kv=(keys[l], values[l]))  # (B, 1, d)
    log_probs = model.softmax.log_prob(h[:, -1]).float()  # (B, V)
    lens.copy_((lens + 1).clamp(max=window))
    col.copy_((col + 1) % C)
    return log_probs, log_probs.argmax(-1)


class StepGraphs:
    """``ring_step`` of one model over one set of buffers, one graph per bucket.

    ``capture``: record each bucket's step as a CUDA graph on first use and replay it after (CUDA only); without,
    the step function is called. ``backend``: torch.compile's for the step function (None: not compiled; 'inductor'
    fuses its kernels before capture; the tests pass 'aot_eager' or a counting backend), at static shapes: one graph
    a bucket. ``buffers``: the rings and inputs, views of which each bucket reads (their first B rows):
    ``ids`` (R, 1), ``memory``/``keys``/``values`` L x (R, C, ...), ``lens`` (R,), ``col`` (1,); ``table`` L x (N, H,
    D); all kept at their addresses for the graphs' lives (``clear`` when they are replaced).
    """

    def __init__(self, model, *, window: int, capture: bool, backend: str | Callable | None = None) -> None:
        self.model, self.window, self.capture = model, window, capture
        fn = self._step
        self.fn = fn if backend is None else torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}

    def _step(self, ids, memory, keys, values, table, lens, col):
        return ring_step(self.model, ids, memory, keys, values, table, lens, col, self.window)

    def clear(self) -> None:
        """Forget the graphs (the buffers they read were replaced)."""
        self.graphs.clear()

    def __call__(self, B: int, ids, memory, keys, values, table, lens, col) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of bucket B on the first B rows of the buffers: (B, V) log-probs and (B,) greedy tokens (on CUDA
        with capture: the graph's own outputs, valid until its next replay)."""
        args = (ids[:B], tuple(m[:B] for m in memory), tuple(k[:B] for k in keys), tuple(v[:B] for v in values),
                tuple(table), lens[:B], col)
        if not self.capture:
            return self.fn(*args)
        if B not in self.graphs:
            self.graphs[B] = self._record(args)
        graph, out = self.graphs[B]
        graph.replay()
        return out

    def _record(self, args) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        """Warm the step up on a side stream (a compiled one compiles there), then capture it. Both run the step
        for real, so the rows' lengths and the column are put back after: the warm-up only wrote the column the
        next step writes again."""
        lens, col = args[-2], args[-1]
        saved = lens.clone(), col.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(*args)
                lens.copy_(saved[0])
                col.copy_(saved[1])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Each bucket's graph in a memory pool of its own: buckets replay in any order, and a shared pool is safe
        # only when graphs replay in the order they were captured. thread_local: the session writer's threads may
        # copy tensors meanwhile, which a global capture would refuse.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self.fn(*args)
        lens.copy_(saved[0])  # capture recorded the step without running it: nothing moved, but to be plain
        col.copy_(saved[1])
        return graph, out
