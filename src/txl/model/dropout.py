"""Dropout with ``nn.Dropout``'s distribution, its training masks drawn cheaply on the CPU.

``Dropout`` draws the *gaps* between dropped elements where the model's plan says (``ComputePlan.gap_dropout``:
``dropout_impl='fast'`` on the CPU). In a row of independent Bernoulli(p) trials the gaps between successes are
independent Geometric(p) variables, so drawing the gaps (``rare_positions``) gives nn.Dropout's distribution, to
float64 rounding, from p * n draws instead of n (the win: benchmarks/README.md, "What the fast path keeps").
Elsewhere ('torch', other devices, torch.compile) torch's own kernel runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rare_positions(n: int, q: float, device: torch.device, *, first: int | None = None) -> torch.Tensor:
    """The sorted positions (int64) of the successes in n independent Bernoulli(q) trials, 0 < q <= 0.5.

    Drawn as gaps: G = floor(log(1 - u) / log(1 - q)) + 1 for u uniform in [0, 1) is Geometric(q), and the
    successes sit at the running sums of the gaps, minus one. Draws come in chunks of ``first`` (default: the mean
    count plus six standard deviations), continued from the last success: the positions do not depend on them."""
    log_miss = math.log1p(-q)
    chunks, start = [], 0
    while True:
        k = first or int((n - start) * q + 6 * math.sqrt((n - start) * q) + 16)
        u = torch.empty(k, dtype=torch.float64, device=device).uniform_()  # (k,)
        misses = torch.log1p(u.neg_()).div_(log_miss).floor_()  # (k,): G - 1, failures before each success
        pos = torch.cumsum(misses, 0).add_(torch.arange(start, start + k, dtype=torch.float64, device=device))
        end = int(torch.searchsorted(pos, float(n)))  # positions are increasing: those below n come first
        chunks.append(pos[:end])
        if end < k:
            break
        start = int(pos[-1]) + 1
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks)).long()  # (about n q,)


class _GapDropout(torch.autograd.Function):
    """dropout(x), or dropout(relu(x)), from the positions of the rarer outcome (``rare_positions``): the dropped
    elements (``dropped``, p <= 0.5: zeros written into x * scale) or the kept ones (x * scale written into zeros).
    Saved for backward: the positions, or with ``relu`` the output (which the next linear layer keeps anyway)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pos: torch.Tensor, scale: float, dropped: bool, relu: bool) -> torch.Tensor:
        y = torch.relu(x) if relu else x
        out = _scatter_scaled(y, pos, scale, dropped, out=y if relu else None)
        ctx.scale, ctx.dropped, ctx.relu = scale, dropped, relu
        ctx.save_for_backward(out if relu else pos)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (saved,) = ctx.saved_tensors
        if ctx.relu:  # the gradient passes, scaled, where the output is positive (kept and x > 0): ReLU's backward
            return torch.ops.aten.threshold_backward(grad, saved, 0).mul_(ctx.scale), None, None, None, None
        return _scatter_scaled(grad.contiguous(), saved, ctx.scale, ctx.dropped), None, None, None, None


def _scatter_scaled(y: torch.Tensor, pos: torch.Tensor, scale: float, dropped: bool,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """y * scale with zeros at ``pos`` (dropped), or zeros with y * scale at ``pos`` (kept); into ``out``
    (y itself, when nothing else reads it) or a new tensor. y is contiguous: positions index its elements."""
    if dropped:
        res = torch.mul(y, scale, out=out) if out is not None else y * scale  # (shape)
        res.view(-1).index_fill_(0, pos, 0.0)
        return res
    kept = y.reshape(-1).index_select(0, pos).mul_(scale)  # (len(pos),)
    res = out.zero_() if out is not None else torch.zeros(y.shape, dtype=y.dtype, device=y.device)
    res.view(-1).index_copy_(0, pos, kept)
    return res


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same p field, same state dict), its training masks drawn from the gaps where ``gaps`` is set
    (other draws than ``nn.Dropout``'s; ``torch.manual_seed`` reproduces them). ``relu``: dropout(relu(x)) in one
    step; its input (fc1's output, read by nothing else) is overwritten where no gradient needs it."""

    gaps: bool = True
    """Whether the gap sampler draws the masks; the model sets it from its plan (``txl.model.plan``)."""

    def __init__(self, p: float = 0.5, *, relu: bool = False) -> None:
        super().__init__(p)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:  # relu: in place where no gradient needs x (fc1's output, read once)
            return (torch.relu(x) if x.requires_grad else x.relu_()) if self.relu else x
        if self.p < 1 and self.gaps and not torch.compiler.is_compiling():  # the gaps, of the rarer outcome
            dropped = self.p <= 0.5
            pos = rare_positions(x.numel(), self.p if dropped else 1.0 - self.p, x.device)
            return _GapDropout.apply(x.contiguous(), pos, 1.0 / (1.0 - self.p), dropped, self.relu)
        return F.dropout(torch.relu(x) if self.relu else x, self.p)  # torch's kernel (at p = 1: all dropped)
