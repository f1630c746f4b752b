"""A generation step as one torch.compile graph: one token per row, its rows written in place into the buffers that
the memory and the cached keys/values are views of.

Shape legend: B rows, K = M + 1 keys (the M rows read and the new one), C a buffer's capacity, L layers, d d_model,
H heads, D head width, N rows of the positional table passed, V vocabulary.

Why: a (B, 1) step of a small model on a CPU is mostly fixed cost: ~280 aten ops, each dispatched from Python, 60%
of a B = 1 step (benchmarks/README.md). Compiled, the step is one graph of extern matmuls, the attention kernel and
a few fused loops. The eager step grows its tensors every token (K = M + 1 keys); a graph of static shapes would
recompile every token, so the graph is made with symbolic sizes (``dynamic=True``): K and the batch are symbols,
and one graph serves every step of every length: at most four in all, as torch specialises a batch of 1 and the
positional table is read as a view until a distance is clamped (``clamp_len``), gathered after.

Static shapes were measured too (buffers of a fixed capacity C, the rows not written yet masked, key j's position
read by its distance to the write index): at B = 8 the attention then streams all C keys and values, and with
C = 512 for ~290 rows read the step was slower than eager (1,084 against 1,316 tokens/s; benchmarks/README.md).
Here the graph reads views of exactly the K rows, written at the last one: the same bytes as the eager step.

The step is the model's own modules (embedding, each layer's attention and feed-forward, the adaptive softmax)
called on tensors the caller (``txl.decoding.Decoder``) keeps: nothing is held here but the compiled function.
Only the paper's relative attention is read this way (its positional term depends on distances alone, and the
cache's table holds W_kR R by distance); other encodings compile the whole forward instead (``Decoder``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from txl.model.attention import RelativeAttention
from txl.model.memory import RowBuffer
from txl.model.positions import Positions

__all__ = ["HEADROOM", "CompiledStep", "compiled_step_error", "room", "step"]

HEADROOM = 64
"""Rows of room a new buffer gets past the rows it is made with: it is replaced (its rows copied once) every
HEADROOM steps, as the eager step's ``append_rows`` does."""


def compiled_step_error(model) -> str | None:
    """Why ``model``'s generation steps cannot run as the compiled step (None: they can)."""
    c = model.config
    if not all(isinstance(layer.attn, RelativeAttention) for layer in model.layers):
        return (f"attn_type={c.attn_type!r}: the compiled step reads the relative attention's positional table by "
                "distance; the other encodings place keys by their index in the window")
    if getattr(c, "cmem_len", 0):
        return f"cmem_len={c.cmem_len}: a compressed memory is rebuilt every few steps, not appended to"
    return None


def step(model, ids: torch.Tensor, memory: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
         values: Sequence[torch.Tensor], table: Sequence[torch.Tensor], pads: torch.Tensor, clamped: bool = True
         ) -> torch.Tensor:
    """Read one token per row, (B, 1) ``ids``, after the first K - 1 rows of each buffer view, writing the last row
    of every view (memory: each layer's input; keys, values: its projections). Returns the next token's (B, V)
    float32 log-probabilities.

    memory: L x (B, K, d); keys, values: L x (B, K, H, D), views whose last row is written here; table: L x (N, H, D),
    W_kR R farthest first (row N-1-n: distance n; N >= K, or N = clamp_len + 1 when distances are clamped: a farther
    key reads row 0); pads: (B,) int64, each row's leading pad rows (hidden keys); clamped: whether some key is
    farther than the table reaches (False: the table's last K rows are the keys' rows as they lie, a view, where the
    clamped reading gathers them). Eval mode, no autograd: the caller's.
    """
    K, N = keys[0].size(1), table[0].size(0)
    j = torch.arange(K, device=ids.device)  # (K,) key index
    if clamped:
        rows = N - 1 - (K - 1 - j).clamp(max=N - 1)  # (K,): key j's row of the table, its distance K-1-j clamped
    mask = (j[None, :] < pads[:, None])[:, None, None, :]  # (B, 1, T=1, K): a real query never sees a pad
    h = model.embed(ids)  # (B, 1, d); eval: no dropout
    u, v = getattr(model, "u", None), getattr(model, "v", None)  # None: each layer's own (untie_r)
    for l, layer in enumerate(model.layers):
        memory[l][:, -1:].copy_(h.to(memory[l].dtype))  # the memory keeps each layer's input
        k, val = layer.attn.keys_values(h)  # (B, 1, H, D) each
        keys[l][:, -1:].copy_(k.to(keys[l].dtype))
        values[l][:, -1:].copy_(val.to(values[l].dtype))
        t = table[l]
        pos = Positions(projected=t.index_select(0, rows) if clamped else t[N - K:])  # (K, H, D): W_kR R(K-1-j)
        h = layer(h, None, mask, pos, u, v, kv=(keys[l], values[l]))  # (B, 1, d)
    return model.softmax.log_prob(h[:, -1]).float()  # (B, V)


def room(tensors: Sequence[torch.Tensor], buffers: Sequence[RowBuffer | None]) -> list[RowBuffer]:
    """Buffers that hold each of ``tensors`` (B, M, ...) as their last rows, with room for one more: their own when
    every one of them can, else new ones with HEADROOM rows of room, the M rows copied in once.

    The views the step reads never start at a buffer's first row nor end at its last (a row to spare at each end):
    torch.compile takes sizes, strides and offsets as symbols but makes a graph of its own for a view at offset 0
    (0 and 1 are specialised) and for one that covers its whole buffer (contiguous), so the step keeps to one kind.
    """
    if all(b is not None and b.ends(t) and t.storage_offset() > 0 and b.end + 1 < b.data.size(1)
           and b.end == buffers[0].end for t, b in zip(tensors, buffers)):
        return list(buffers)
    out = []
    for t in tensors:
        M = t.size(1)
        buf = RowBuffer(t.new_empty(t.size(0), 1 + M + HEADROOM, *t.shape[2:]))  # (B, C, ...)
        buf.data[:, 1:M + 1] = t  # row 0 spare
        buf.end = M + 1
        out.append(buf)
    return out


class CompiledStep:
    """``step`` of one model through torch.compile (``compile=False``: the same function eagerly, what the tests
    compare the graph with). ``backend``: torch.compile's (None: inductor), a name or a callable."""

    def __init__(self, model, *, compile: bool = True, backend: str | Callable | None = None) -> None:
        why = compiled_step_error(model)
        if why is not None:
            raise ValueError(f"a compiled generation step is not available: {why}; generate without compile")
        self.model, self.compiled = model, compile
        self.made: set[tuple[bool, bool]] = set()  # the graphs made: (one row, clamped); torch specialises a batch of 1
        self.pads: tuple[tuple, torch.Tensor] | None = None  # the rows' pad counts on the device, while they last
        fn = self._step
        self.fn = torch.compile(fn, backend=backend or "inductor", dynamic=True, fullgraph=True) if compile else fn

    def _step(self, ids, memory, keys, values, table, pads, clamped):
        return step(self.model, ids, memory, keys, values, table, pads, clamped)

    def __call__(self, ids: torch.Tensor, buffers: Sequence[RowBuffer], start: int, table: Sequence[torch.Tensor],
                 pads: Sequence[int]) -> torch.Tensor:
        """Step (B, 1) ``ids`` on ``buffers`` (the L memories, then the L keys, then the L values, all ending at the
        same row with room for one more: ``room``) whose rows read start at ``start``; every buffer's ``end``
        moves one row on. ``table``: each layer's whole positional table (N, H, D), N >= K unless clamped.
        Returns (B, V) float32 log-probs."""
        L = len(self.model.layers)
        n = buffers[0].end
        views = [b.data.narrow(1, start, n + 1 - start) for b in buffers]  # (B, K, ...) each
        clamped = table[0].size(0) < n + 1 - start  # a graph for each (distances clamp from some step on)
        key = (tuple(pads), ids.device)
        if self.pads is None or self.pads[0] != key:  # made when the rows change, not every step: on a GPU a copy
            self.pads = (key, torch.tensor(pads, device=ids.device))  # from host memory waits for the device
        args = (ids, views[:L], views[L:2 * L], views[2 * L:], tuple(table), self.pads[1], clamped)
        kind = (ids.size(0) == 1, clamped)
        if not self.compiled or kind in self.made:  # the graph exists: no marks, nothing to configure
            out = self.fn(*args)
        else:  # the call that makes the graph (both settings cost ~0.1 ms a step, a few % of a small model's step)
            for v in views:  # K a symbol from the first graph on (dynamic=True alone leaves a view's sizes static)
                torch._dynamo.mark_dynamic(v, 1)
            # The model's float attributes (layer-norm eps, dropout p) as constants: dynamic=True would trace them as
            # symbols, and dynamo would then trace the whole step a second time to make them constants again.
            with torch._dynamo.config.patch(specialize_float=True):
                out = self.fn(*args)
            self.made.add(kind)
        for b in buffers:
            b.end = n + 1
        return out
