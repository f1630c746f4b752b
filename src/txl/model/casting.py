"""The layers' weights cast to autocast's dtype in one op per forward, and their gradients back in one.

Under autocast every float32 weight a matmul reads is cast where it is used (one copy kernel per weight and
bias), and backward casts each gradient back (one more): at NVIDIA's WikiText-103 shape 7 weights a layer, 16
layers, ~224 small copy kernels a step. ``ComputeConfig.cast_weights='grouped'`` casts all of them in one
``_foreach_copy_`` at the start of the forward and their gradients back in one in backward (CUDA's multi-tensor
kernel: a few launches for all of them), with the same numbers: the same rounding to bf16 / fp16, the gradient
in the compute dtype widened exactly to float32, contributions of one weight's several uses summed where they
were (in the compute dtype).

The trade-offs (``ComputeConfig.cast_weights``): all the layers' cast weights exist from the forward's start (under
autocast each exists from its layer on, and both are kept for backward in training); every gradient reaches
its float32 parameter at the end of backward, after the last layer's, so a data-parallel wrapper (DDP) that
overlaps its all-reduce with backward would overlap nothing: 'auto' groups only outside a process group of
more than one, and never parameters that are not plain tensors (FSDP's sharded ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def matmul_weights(modules: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every weight and bias of the ``nn.Linear`` modules in ``modules``: what autocast casts."""
    return [(m, n) for m in modules.modules() if isinstance(m, nn.Linear)
            for n, p in m._parameters.items() if p is not None]


def norm_weights(modules: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every weight and bias of the ``nn.LayerNorm`` modules in ``modules``: what a 16-bit residual
    stream's norms read in its dtype (``kernels.layer_norm``: CUDA's kernel takes one dtype for all three)."""
    return [(m, n) for m in modules.modules() if isinstance(m, nn.LayerNorm)
            for n, p in m._parameters.items() if p is not None]


def multi_process() -> bool:
    """Whether a process group of more than one process is running (DDP, FSDP). Work grouped across layers
    (one cast, one projection) gives its gradients only at the end of backward, where DDP reduces each layer's
    while backward runs: under a group the layers keep their own ops."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def groupable(params: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether the grouped cast applies: float32 plain parameters (not FSDP's DTensors) under an autocast dtype
    of their own, and no multi-process group (DDP would lose its overlap of all-reduce with backward)."""
    if not params or dtype == params[0].dtype or multi_process():
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


class _CastRows(torch.autograd.Function):
    """Row blocks of parameters -> new tensors in ``dtype`` assembled from them (and pad rows), in one op; backward:
    each parameter's gradient assembled from its blocks' gradients and cast back, in one op."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, layouts: tuple[tuple[Piece, ...], ...], pads: tuple[float, ...],
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = [sum(p if isinstance(p, int) else p[2] - p[1] for p in layout) for layout in layouts]
        out = [params[_first(layout)].new_empty(n, *params[_first(layout)].shape[1:], dtype=dtype)
               for n, layout in zip(rows, layouts)]
        dst, src = [], []
        fills: dict[float, torch.Tensor] = {}  # each pad value's source: one flat float32 tensor, cut into views
        for value in set(pads):
            need = [p * params[_first(lay)][0].numel() for lay, v in zip(layouts, pads) if v == value
                    for p in lay if isinstance(p, int)]
            if need:
                fills[value] = params[0].new_full((max(need),), value)
        for o, layout, value in zip(out, layouts, pads):
            at = 0
            for p in layout:
                n = p if isinstance(p, int) else p[2] - p[1]
                dst.append(o[at:at + n])
                # A pad block reads the first rows' worth of its value's flat tensor, shaped as the rows.
                src.append(fills[value][: o[at:at + n].numel()].view_as(o[at:at + n]) if isinstance(p, int)
                           else params[p[0]][p[1]:p[2]])
                at += n
        # One copy kernel for every block (src all float32, dst all ``dtype``: CUDA's multi-tensor fast path).
        torch._foreach_copy_(dst, src)
        ctx.layouts, ctx.shapes = layouts, [(p.shape, p.dtype) for p in params]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        blocks: list[list[tuple[int, torch.Tensor, int, int]]] = [[] for _ in ctx.shapes]  # per parameter
        for g, layout in zip(grads, ctx.layouts):
            at = 0
            for p in layout:
                n = p if isinstance(p, int) else p[2] - p[1]
                if g is not None and not isinstance(p, int):
                    blocks[p[0]].append((at, g, p[1], p[2]))
                at += n
        out: list[torch.Tensor | None] = [None] * len(ctx.shapes)
        dst, src = [], []
        for k, ((shape, dtype), have) in enumerate(zip(ctx.shapes, blocks)):
            if not have:
                continue  # no use of this parameter had a gradient: None, as an unused parameter's
            covered = sum(stop - start for _, _, start, stop in have)
            # Rows no used block covers get a zero gradient (what a split or slice backward fills them with).
            make = torch.empty if covered == shape[0] else torch.zeros
            out[k] = make(shape, dtype=dtype, device=have[0][1].device)
            for at, g, start, stop in have:
                dst.append(out[k][start:stop])
                src.append(g[at:at + stop - start])
        if dst:
            torch._foreach_copy_(dst, src)
        return None, None, None, *out


def _first(layout: tuple[Piece, ...]) -> int:
    """The parameter a layout's first block is cut from (its outputs' width and device)."""
    return next(p[0] for p in layout if not isinstance(p, int))


def cast_rows(params: list[torch.Tensor], layouts: list[list[Piece]], pads: list[float],
              dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One output per layout in ``dtype``, its rows the listed blocks of ``params`` in order, a pad block filled with
    its output's ``pads`` value; gradients flow back to ``params`` (float32 when ``groupable``).

    The adaptive softmax's tied (V, e) table, its cluster rows and biases reach the compute dtype this way: one
    copy kernel forward, one backward, where a cast of each parameter, a cat for the head and one per padded
    cluster, and the split's cat and each cast back in backward took 12 launches at NVIDIA's shape (3 tail
    clusters). The same numbers: the same rounding, the rows laid out as the cat made them; a parameter row that no
    block of a used output covers gets a zero gradient, a parameter no used output reads gets None.
    """
    return _CastRows.apply(dtype, tuple(tuple(lay) for lay in layouts), tuple(pads), *params)
