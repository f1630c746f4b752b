"""Dropout: ``nn.Dropout`` semantics by default, and a cheaper 16-bit mask (``dropout_impl='fast16'``).

``dropout(config, p)`` returns the module ``ModelConfig.dropout_impl`` asks for:

* 'torch': ``nn.Dropout`` (exactly p, torch's RNG stream), and ``ReLUDropout`` for dropout(relu(x)) in place;
* 'fast16': ``FastDropout`` / ``FastReLUDropout``, a mask of 16-bit draws kept as one byte per element,
  p rounded to a multiple of 2**-16 (tests/test_dropout.py checks the rate and the gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """A bool mask (True = keep) with drop probability p quantised to 2**-16, and the scale 1 / P(keep).

    On CPU ``nn.Dropout`` draws one float per element with a serial Bernoulli sampler and keeps the scaled
    noise (4 bytes per element) for backward. Here one 64-bit ``random_`` call yields four 16-bit draws; an
    element is kept when its draw clears a threshold. The drop probability is therefore p rounded to a
    multiple of 2**-16, and the scale 1 / (1 - that probability), so every element keeps its expectation.
    """
    n = shape.numel()
    drop = round(p * 65536)
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)  # (ceil(n/4),)
    keep = bits.view(torch.int16)[:n].view(shape) >= drop - 32768  # (shape): uniform int16 draws
    return keep, 65536 / (65536 - drop)


def _apply(x: torch.Tensor, keep: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * keep * scale in one pass (into ``out``, which may be x itself); keep is bool, read as its 0/1 bytes.

    ``addcmul`` on the mask's bytes: one vectorised pass, where ``torch.where`` and a scaling take two."""
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


class FastDropout(nn.Dropout):
    """``nn.Dropout`` (same p field, same state dict) with the cheaper mask of ``keep_mask``.

    Not the same draws as ``nn.Dropout`` and p quantised to 2**-16; ``torch.manual_seed`` reproduces the
    masks. Identity in evaluation. Under torch.compile: ``F.dropout``, which the compiler fuses.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if torch.compiler.is_compiling():
            return F.dropout(x, self.p, training=True)
        keep, scale = keep_mask(x.shape, self.p, x.device)
        return _ScaleMask.apply(x, keep, scale)


class ReLUDropout(nn.Dropout):
    """dropout(relu(x)) with ``nn.Dropout``'s semantics. ``inplace=True``: for an input nothing else
    reads (a fresh linear output), the ReLU overwrites it instead of allocating another tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu_(x) if self.inplace else torch.relu(x)
        return F.dropout(r, self.p, self.training)


class FastReLUDropout(nn.Dropout):
    """dropout(relu(x)) in one step with ``FastDropout``'s mask: no ReLU input or mask kept for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or torch.compiler.is_compiling():
            r = torch.relu_(x) if self.inplace else torch.relu(x)
            return F.dropout(r, self.p, self.training)
        keep, scale = keep_mask(x.shape, self.p, x.device)
        return _ReLUScaleMask.apply(x, keep, scale)


def dropout(config: ModelConfig, p: float, *, relu: bool = False) -> nn.Module:
    """The dropout module ``config.dropout_impl`` asks for; ``relu``: dropout(relu(x)) in place."""
    if config.dropout_impl == "fast16":
        return FastReLUDropout(p, inplace=True) if relu else FastDropout(p)
    return ReLUDropout(p, inplace=True) if relu else nn.Dropout(p)
