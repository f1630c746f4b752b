"""The layers' weights cast to autocast's dtype in one op per forward, and their gradients back in one.

Under autocast each float32 weight is cast where a matmul reads it, and each gradient cast back: small copy kernels
per weight and step. ``ComputeConfig.cast_weights='grouped'`` casts them all by one ``_foreach_copy_`` and their
gradients back by one, with the same numbers (the win: benchmarks/README.md, "What the fast path keeps"). Every
gradient then arrives at the end of backward, which would leave DDP's all-reduce nothing to overlap: 'auto' groups
only outside a process group of more than one, and only plain (not FSDP's sharded) parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


def matmul_weights(modules: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every weight and bias of the ``nn.Linear`` modules in ``modules``: what autocast casts."""
    return [(m, n) for m in modules.modules() if isinstance(m, nn.Linear)
            for n, p in m._parameters.items() if p is not None]


def norm_weights(modules: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every weight and bias of the ``nn.LayerNorm`` modules in ``modules``: what a 16-bit
    stream's norms read in its dtype (``kernels.layer_norm``)."""
    return [(m, n) for m in modules.modules() if isinstance(m, nn.LayerNorm)
            for n, p in m._parameters.items() if p is not None]


def groupable(params: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether the grouped cast applies: float32 plain parameters (not FSDP's DTensors) under an autocast dtype
    of their own, and no process group of more than one (DDP would lose its overlap of all-reduce with backward)."""
    if not params or dtype == params[0].dtype or (dist.is_available() and dist.is_initialized()
                                                  and dist.get_world_size() > 1):
        return False
    return all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in params)


@contextlib.contextmanager
def cast_in_place(slots: list[tuple[nn.Module, str]], dtype: torch.dtype) -> Iterator[None]:
    """Within the block, each (module, name) parameter reads as its copy in ``dtype`` (one grouped cast, gradients
    flowing back to the parameter); restored on exit, also on an error."""
    params = [m._parameters[n] for m, n in slots]
    cast = cast_rows(params, [[(i, 0, p.shape[0])] for i, p in enumerate(params)], [0.0] * len(params), dtype)
    try:
        for (m, n), c in zip(slots, cast):
            m._parameters[n] = c  # read by the module's forward as self.<name>; not a Parameter: never registered
        yield
    finally:
        for (m, n), p in zip(slots, params):
            m._parameters[n] = p


Piece = tuple[int, int, int] | int
"""One block of rows of a ``cast_rows`` output: (parameter index, first row, end row), or a number of pad rows."""


def _spans(layout: tuple[Piece, ...]) -> Iterator[tuple[int, int, Piece]]:
    """(first row in the output, number of rows, piece) of each block of a layout."""
    at = 0
    for p in layout:
        n = p if isinstance(p, int) else p[2] - p[1]
        yield at, n, p
        at += n


class _CastRows(torch.autograd.Function):
    """Row blocks of parameters -> new tensors in ``dtype`` assembled from them (and pad rows), in one op; backward:
    each parameter's gradient assembled from its blocks' gradients and cast back, in one op."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, layouts: tuple[tuple[Piece, ...], ...], pads: tuple[float, ...],
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, dst, src, pad_rows = [], [], [], {}
        for layout, value in zip(layouts, pads):
            spans = list(_spans(layout))
            like = params[next(p[0] for _, _, p in spans if not isinstance(p, int))]  # the outputs' width and device
            out.append(like.new_empty(sum(n for _, n, _ in spans), *like.shape[1:], dtype=dtype))
            for at, n, p in spans:
                if isinstance(p, int):
                    pad_rows.setdefault(value, []).append(out[-1][at:at + n])
                else:
                    dst.append(out[-1][at:at + n])
                    src.append(params[p[0]][p[1]:p[2]])
        for value, blocks in pad_rows.items():  # each pad value's source: one flat float32 tensor, cut into views
            fill = params[0].new_full((max(b.numel() for b in blocks),), value)
            dst += blocks
            src += [fill[:b.numel()].view_as(b) for b in blocks]
        # One copy kernel for every block (src all float32, dst all ``dtype``: CUDA's multi-tensor fast path).
        torch._foreach_copy_(dst, src)
        ctx.layouts, ctx.shapes = layouts, [(p.shape, p.dtype) for p in params]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        blocks: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in ctx.shapes]  # per parameter
        for g, layout in zip(grads, ctx.layouts):
            for at, n, p in _spans(layout) if g is not None else ():
                if not isinstance(p, int):
                    blocks[p[0]].append((p[1], p[2], g[at:at + n]))
        out: list[torch.Tensor | None] = [None] * len(ctx.shapes)  # None: no use of the parameter had a gradient
        dst, src = [], []
        for k, ((shape, dtype), have) in enumerate(zip(ctx.shapes, blocks)):
            if have:  # rows no used block covers get a zero gradient (what a split or slice backward fills them with)
                make = torch.empty if sum(stop - start for start, stop, _ in have) == shape[0] else torch.zeros
                out[k] = make(shape, dtype=dtype, device=have[0][2].device)
                dst += [out[k][start:stop] for start, stop, _ in have]
                src += [g for _, _, g in have]
        if dst:
            torch._foreach_copy_(dst, src)
        return None, None, None, *out


def cast_rows(params: list[torch.Tensor], layouts: list[list[Piece]], pads: list[float],
              dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One output per layout in ``dtype``, its rows the listed blocks of ``params`` in order, a pad block filled with
    its output's ``pads`` value; gradients flow back to ``params`` (float32 when ``groupable``). The same numbers as
    casts, cats and slices: a parameter row no used block covers gets a zero gradient, an unread parameter None."""
    return _CastRows.apply(dtype, tuple(tuple(lay) for lay in layouts), tuple(pads), *params)
