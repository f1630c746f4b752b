"""Evaluation without the copies: each layer's keys and values live in a ring the segments write in place, and the
segment is captured once as a CUDA graph and replayed (``txl eval --graphs``, ``txl.evaluate(graphs=True)``).

Shape legend: B streams, T segment length, S = mem_len memory rows, R = S + T ring columns, N rows of the positional
table, L layers, d d_model, H heads, D head width.

Why: ``txl.graphs.StaticSteps`` keeps the memory and the key/value cache outside its graph and hands them in every
segment: per layer a padded memory copied into the graph's static input, a ``torch.cat`` of cached and new keys and
of values inside it, and the last S rows copied out again. On an H200 at NVIDIA's shape (B 32, T 64, M 640) that was
118 device-to-device copies (1.14 ms of a 6.5 ms segment) and ~0.56 ms of concatenation, and the host (8.5 ms)
stayed above the device. Here nothing is copied in or out but the (B, T) ids and labels:

* each layer's keys and values are a ring of R columns (``StaticEval.keys``, ``values``), never moved: a segment
  writes its T rows' keys and values at columns ``(start + t) mod R`` (``index_copy_``, one kernel per ring) and its
  attention reads all R columns. No memory is kept at all: in evaluation the memory's only use is its keys and
  values, which the ring holds already;
* the softmax does not care about the keys' order; what does is the positional term and the mask. Key column j is
  at distance ``(w_i - j) mod R`` from query i (``w_i`` the query's own column). Relative attention depends on
  distances alone (Dai et al. 2019, section 3.3), so terms (b) + (d) become one matmul against the N distinct
  distances of W_kR R and a gather by that distance (``Positions.index``; ``rel_shift`` assumes keys in distance
  order), and the mask hides a column farther than the query's position in the stream (not written yet, or
  overwritten), a future one, and, with ``same_length``, one beyond the common horizon. ``start`` and the rows filled
  are device tensors the segment advances: the first segment and the thousandth are the same graph;
* the per-token NLL is written into a static buffer and the loss's sums accumulate on the device (read once, at
  the end of an evaluation).

The segment is ``ring_segment``: the model's own modules (embedding, each layer over ``kv=(keys, values)`` as the
decode step of ``txl.captured_step`` runs them, the adaptive softmax) called on these buffers. On CUDA it runs through
torch.compile (inductor) and, after ``WARMUP`` segments on a side stream, is captured whole with
``torch.cuda.graph`` and replayed. On a CPU the same function runs through torch.compile (one graph), which is how
the tests check the capture's discipline: equal to the model's evaluation, one graph and no recompilation, the
buffers' addresses fixed, no host sync inside a segment. A shorter segment (the last of a split) runs the same
function uncompiled on the same ring: one segment, no copy.

What it cannot take (``static_eval_error``: an encoding other than the paper's relative one, a compressed memory,
ext_len) is evaluated by ``StaticSteps`` as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from txl.config import Context
from txl.labels import IGNORE_INDEX
from txl.model import kernels
from txl.model.attention import RelativeAttention
from txl.model.plan import resolved
from txl.model.positions import Positions

log = logging.getLogger(__name__)

__all__ = ["WARMUP", "StaticEval", "compile_segment", "ring_mask", "ring_segment", "static_eval_error"]

WARMUP = 2
"""Segments run uncaptured on a side stream before the capture on CUDA (torch.compile's kernels made, cuBLAS and
the allocator settled), as ``txl.captured_step`` warms its steps up."""


def compile_segment(backend: str | Callable | None = None) -> Callable[..., None]:
    """``ring_segment`` through torch.compile at static shapes, without torch's own CUDA graphs (the segment is
    captured whole around it); ``backend``: torch.compile's (None: inductor)."""
    return torch.compile(ring_segment, backend=backend or "inductor", dynamic=False)


def static_eval_error(model, context: Context) -> str | None:
    """Why ``model``'s evaluation in ``context`` cannot run over rings (None: it can)."""
    c = model.config
    if not all(type(layer.attn) is RelativeAttention for layer in model.layers):
        return (f"attn_type={c.attn_type!r}: the ring reads the paper's relative positional table by distance; "
                "other encodings place keys by their index in the window")
    if getattr(c, "cmem_len", 0):
        return f"cmem_len={c.cmem_len}: a compressed memory is rebuilt every few segments, not written in a ring"
    if context.ext_len:
        return f"ext_len={context.ext_len} re-feeds rows each segment (a ring holds each position once)"
    return None


def on_side_stream(fn: Callable[[], object], device: torch.device) -> None:
    """``fn()`` on a side stream that waits for, and is waited for by, ``device``'s current stream: the warm-up runs
    before a CUDA-graph capture (torch's recipe: the lazy initialisations they trigger stay out of the capture's
    memory pool). ``txl.step_graph`` warms up with it too."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)


def ring_mask(start: torch.Tensor, filled: torch.Tensor, T: int, R: int, horizon: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns this segment's T queries write and what each reads of a ring of R columns: (T,) columns, and
    (T, R) each (query, column)'s distance (``(w_i - j) mod R``) and whether it is hidden.

    start: (1,) int64 the first query's column; filled: (1,) int64 memory rows the stream has (min(positions read,
    S)); horizon: with same_length, the distance from which keys are hidden (mem_len, +1 in the TensorFlow style;
    ``positions.attention_mask``), 0 without. Query i sits at stream position p + i; column j holds position p + i -
    dist, which is this stream's and still in the ring for dist <= i + filled (filled <= S = R - T), and a future
    query of this segment for dist > i + S (its distance wraps round): so hidden is dist > i + filled, and with
    same_length dist >= horizon. Device tensors only: no host sync, one graph whatever start and filled are."""
    device = start.device
    i = torch.arange(T, device=device)  # (T,) query
    w = (start + i) % R  # (T,) the column query i writes
    dist = (w[:, None] - torch.arange(R, device=device)[None, :]) % R  # (T, R)
    hidden = dist > i[:, None] + filled  # (T, R)
    if horizon:
        hidden = hidden | (dist >= horizon)
    return w, dist, hidden


def ring_segment(model, ids: torch.Tensor, labels: torch.Tensor, keys: Sequence[torch.Tensor],
                 values: Sequence[torch.Tensor], table: Sequence[torch.Tensor], start: torch.Tensor,
                 filled: torch.Tensor, nll: torch.Tensor, sums: torch.Tensor, *, mem_len: int, horizon: int) -> None:
    """Read one (B, T) segment ``ids`` after what the rings hold, scoring ``labels``; writes its keys and values into
    the rings, its per-token NLL into ``nll`` (B, T) and adds [NLL sum, scored tokens] to ``sums`` (2,) float64, and
    advances ``start`` (mod R) and ``filled`` (capped at ``mem_len``) in place: the next segment's.

    keys, values: L x (B, R, H, D) with R >= mem_len + T; table: L x (N, H, D), W_kR R farthest first (row N-1-n:
    distance n; a farther key reads row 0, as a distance clamped at clamp_len does); start, filled: (1,) int64
    (``ring_mask``). Everything a device tensor, nothing read back: one graph whatever the values. Eval mode, no
    autograd: the caller's."""
    B, T = ids.shape
    R, N = keys[0].size(1), table[0].size(0)
    w, dist, hidden = ring_mask(start, filled, T, R, horizon)  # (T,), (T, R), (T, R)
    rows = N - 1 - dist.clamp(max=N - 1)  # (T, R): each (query, column)'s row of the table
    mask = hidden  # (T, R), True where hidden
    h = model.drop(model.embed(ids))  # (B, T, d); eval: no dropout
    u, v = getattr(model, "u", None), getattr(model, "v", None)  # None: each layer's own (untie_r)
    for l, layer in enumerate(model.layers):
        k, val = layer.attn.keys_values(h)  # (B, T, H, D) each
        keys[l].index_copy_(1, w, k.to(keys[l].dtype))
        values[l].index_copy_(1, w, val.to(values[l].dtype))
        pos = Positions(projected=table[l], index=rows)  # (N, H, D) gathered by (T, R) distances
        h = layer(h, None, mask, pos, u, v, kv=(keys[l], values[l]))  # (B, T, d)
    h = model.drop(h)
    out = model.softmax.nll(h.reshape(B * T, -1), labels.reshape(-1)).view(B, T)  # (B, T)
    nll.copy_(out)
    sums.add_(torch.stack([out.double().sum(), (labels != IGNORE_INDEX).sum().double()]))
    start.copy_((start + T) % R)
    filled.copy_((filled + T).clamp(max=mem_len))


class StaticEval:
    """``ring_segment`` of one model over buffers made once, for one evaluation (or one group of documents: ``reset``
    starts the streams again). Call it with each segment's (B, T) ids and labels: the (B, T) per-token NLL (the
    buffer's own, valid until the next call); ``sums()`` the device's [NLL sum, tokens scored] so far.

    ``context``: the evaluation's (mem_len, clamp_len, same_length; ``static_eval_error`` says what it refuses).
    ``capture``: record the segment as a CUDA graph after ``warmup`` segments (default: on CUDA). ``compile``: the
    segment through torch.compile at static shapes (``backend``: its backend, None for inductor; the tests pass a
    counting one). The first segment fixes B and T; a shorter one (the last of a split) runs uncompiled on the same
    rings; a longer one, or another B, is refused.
    """

    def __init__(self, model, context: Context, *, capture: bool | None = None, compile: bool = True,
                 backend: str | Callable | None = None, warmup: int = WARMUP) -> None:
        why = static_eval_error(model, context)
        if why is not None:
            raise ValueError(f"StaticEval: {why}; evaluate through txl.graphs.StaticSteps (txl.evaluate picks it)")
        device = next(model.parameters()).device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and not compile and resolved("cluster_rows", model.compute.cluster_rows, "cuda") == "selected":
            raise ValueError("cluster_rows='selected' reads each tail cluster's row count on the host (nonzero), "
                             "which a captured segment cannot: compile it, or set --compute.cluster_rows all")
        self.model, self.context, self.device, self.warmup = model, context, device, warmup
        self.horizon = context.mem_len + (context.same_length_style == "tensorflow") if context.same_length else 0
        self.fn = compile_segment(backend) if compile else ring_segment
        self.buffers: dict[str, torch.Tensor] | None = None  # made by the first segment
        self.keys: tuple[torch.Tensor, ...] = ()
        self.values: tuple[torch.Tensor, ...] = ()
        self.table: tuple[torch.Tensor, ...] = ()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.runs = 0  # full segments run (warm-up ones included)

    def _allocate(self, B: int, T: int) -> None:
        """The rings (in the dtype the layers' matmuls produce: autocast's, if on), the positional table for R
        distances (clamped at clamp_len), the inputs and outputs."""
        c, ctx, device = self.model.config, self.context, self.device
        R = ctx.mem_len + T
        dtype = kernels.compute_dtype(next(self.model.parameters()))
        attns = [layer.attn for layer in self.model.layers]
        self.table = self.model.encoding.grow_table(attns, (), R, ctx.clamp_len, d_model=c.d_model,
                                                    dtype=next(self.model.parameters()).dtype, device=device)
        self.keys = tuple(torch.zeros(B, R, c.n_head, c.d_head, dtype=dtype, device=device) for _ in attns)
        self.values = tuple(torch.zeros(B, R, c.n_head, c.d_head, dtype=dtype, device=device) for _ in attns)
        self.buffers = {
            "ids": torch.zeros(B, T, dtype=torch.int64, device=device),  # (B, T)
            "labels": torch.full((B, T), IGNORE_INDEX, dtype=torch.int64, device=device),  # (B, T)
            "nll": torch.zeros(B, T, dtype=torch.float32, device=device),  # (B, T)
            "sums": torch.zeros(2, dtype=torch.float64, device=device),  # NLL sum, tokens scored
            "start": torch.zeros(1, dtype=torch.int64, device=device),  # the next segment's first column
            "filled": torch.zeros(1, dtype=torch.int64, device=device),  # memory rows the streams have
        }

    def reset(self) -> None:
        """Start the streams again (the rings' old columns are hidden until written: ``filled`` is 0) and the
        sums from zero; the buffers and the captured graph are kept."""
        if self.buffers is not None:
            for name in ("start", "filled", "sums"):
                self.buffers[name].zero_()

    def sums(self) -> torch.Tensor:
        """(2,) float64 on the device: the NLL summed over every token scored since the start (or ``reset``), and
        their count."""
        if self.buffers is None:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        return self.buffers["sums"]

    def _args(self, ids: torch.Tensor, labels: torch.Tensor, nll: torch.Tensor) -> tuple:
        b = self.buffers
        return (self.model, ids, labels, self.keys, self.values, self.table, b["start"], b["filled"], nll, b["sums"])

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        if labels is None or labels.shape != input_ids.shape:
            raise ValueError(f"StaticEval scores labels of the segment's shape {tuple(input_ids.shape)}, got "
                             f"{None if labels is None else tuple(labels.shape)}")
        self.model.check_inputs(input_ids, labels, context=self.context)
        if self.buffers is None:
            self._allocate(B, T)
        b = self.buffers
        Bs, Ts = b["ids"].shape
        if B != Bs or T > Ts:
            raise ValueError(f"StaticEval was built for segments of ({Bs}, {Ts}) tokens and got ({B}, {T}): "
                             "a shorter segment runs, a longer one or another batch needs its own StaticEval")
        options = dict(mem_len=self.context.mem_len, horizon=self.horizon)
        if T < Ts:  # the last, shorter segment: the same rings, uncompiled (a new shape would compile again)
            nll = b["nll"][:, :T]  # (B, T) view
            ring_segment(*self._args(input_ids, labels, nll), **options)
            return nll
        b["ids"].copy_(input_ids)
        b["labels"].copy_(labels)
        self._run(options)
        return b["nll"]

    def _run(self, options: dict) -> None:
        """The full segment over the buffers: as it is (no capture), warming up on a side stream, captured, or
        replayed."""
        b = self.buffers
        args = self._args(b["ids"], b["labels"], b["nll"])
        if not self.capture:
            self.fn(*args, **options)
        elif self.graph is not None:
            self.graph.replay()
        elif self.runs < self.warmup:
            on_side_stream(lambda: self.fn(*args, **options), self.device)
        else:
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: another thread's CUDA work (a checkpoint writer's copies) is not this capture's.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self.fn(*args, **options)
            except RuntimeError as err:  # a capture runs nothing: the buffers are as before, the segment runs again
                log.warning("the evaluation segment could not be captured as a CUDA graph (%s); it runs uncaptured "
                            "from here on", str(err).splitlines()[0])
                self.capture = False
                self.fn(*args, **options)
            else:
                self.graph = graph
                graph.replay()  # the capture recorded the segment; this runs it
        self.runs += 1
