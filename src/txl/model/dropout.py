"""Dropout with a cheaper mask: 16 random bits per element, kept as one byte for the backward pass.

On CPU, ``nn.Dropout`` draws one float per element with a serial Bernoulli sampler (MKL's is used only on
Intel processors), divides that noise by 1 - p and keeps it (4 bytes per element) for the backward pass.
Here one 64-bit ``random_`` call yields four 16-bit draws; an element is kept when its draw clears a
threshold. The drop probability is therefore p rounded to a multiple of 2**-16 (0.1 -> 0.1000061), and
the scale is 1 / (1 - that probability), so every element keeps its expectation exactly. The global torch
generator supplies the bits, so ``torch.manual_seed`` reproduces the masks. Identity in evaluation.

The mask is applied as ``addcmul(0, x, mask, value=scale)`` on its bytes (a bool tensor viewed as uint8):
one vectorised pass, where ``torch.where`` on a bool mask followed by a scaling takes about four times as
long on CPU.
"""

from __future__ import annotations

import torch
from torch import nn


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """A bool mask (True = keep) with drop probability p quantised to 2**-16, and the scale 1 / P(keep)."""
    n = shape.numel()
    drop = round(p * 65536)
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)  # (ceil(n/4),)
    keep = bits.view(torch.int16)[:n].view(shape) >= drop - 32768  # (shape): uniform int16 draws
    return keep, 65536 / (65536 - drop)


def _apply(x: torch.Tensor, keep: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * keep * scale in one pass (into ``out``, which may be x itself); keep is bool, read as its 0/1 bytes."""
    return torch.addcmul(x.new_zeros(()), x, keep.view(torch.uint8), value=scale, out=out)


class _ScaleMask(torch.autograd.Function):
    """x * keep * scale, saving only the one-byte mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _apply(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return _apply(grad, keep, ctx.scale), None, None


class _ReLUScaleMask(torch.autograd.Function):
    """relu(x) * keep * scale, saving nothing of its own: the backward mask is (output > 0).

    An element passes the gradient exactly when it was kept and x > 0, i.e. when its output is positive
    (scale > 0). The output is the next linear layer's input, which autograd keeps anyway.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        r = torch.relu(x)
        out = _apply(r, keep, scale, out=r)
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        # threshold_backward(grad, out, 0) = grad where out > 0, else 0: ReLU's own vectorised backward.
        return torch.ops.aten.threshold_backward(grad, out, 0).mul_(ctx.scale), None, None


class Dropout(nn.Dropout):
    """Drop-in ``nn.Dropout`` (same p, same state dict) with the cheaper mask above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep, scale = keep_mask(x.shape, self.p, x.device)
        return _ScaleMask.apply(x, keep, scale)


class ReLUDropout(Dropout):
    """dropout(relu(x)) in one step: one mask, and no ReLU input or mask of its own kept for backward.

    ``inplace=True`` (for an input nothing else reads, such as a fresh linear output): without dropout
    (evaluation, or p = 0) the ReLU overwrites its input instead of allocating another tensor.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return torch.relu_(x) if self.inplace else torch.relu(x)
        keep, scale = keep_mask(x.shape, self.p, x.device)
        return _ReLUScaleMask.apply(x, keep, scale)
