"""Dropout: nn.Dropout's distribution from cheaper masks by default, ``nn.Dropout`` itself, or a 16-bit mask.

``dropout(config, p)`` returns the module ``ModelConfig.dropout_impl`` asks for:

* 'fast32' (the default): ``FastDropout`` / ``FastReLUDropout`` with 32 random bits per element, so an element
  is dropped with probability p to within 2**-33 (finer than float32's own 0.1, and than torch's CUDA
  dropout, whose uniforms have 24 bits); kept ones are scaled by 1 / (1 - p) as ``nn.Dropout`` does. On
  CPU the mask is drawn from torch's generator, 3.5x faster than ``nn.Dropout``'s serial Bernoulli sampler,
  and kept as one byte per element instead of four; on other devices torch's own fused kernel runs;
* 'torch': ``nn.Dropout`` (torch's RNG stream: the draws ``F.dropout`` makes from the same seed), and
  ``ReLUDropout`` for dropout(relu(x)) in place;
* 'fast16': the same modules with 16 random bits per element, p rounded to a multiple of 2**-16 and the
  scale to match (0.1 -> 0.1000061): the cheapest mask, a slightly different distribution.

tests/test_dropout.py checks the rates, the scale, the gradients and reproducibility.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig

_INT = {16: torch.int16, 32: torch.int32}


def keep_mask(shape: torch.Size, p: float, device: torch.device, bits: int = 16) -> tuple[torch.Tensor, float]:
    """A bool mask (True = keep) that drops with probability p to ``bits`` bits, and the scale for kept values.

    ``nn.Dropout`` on CPU draws one double per element with a serial Bernoulli sampler and keeps the scaled
    noise (4 bytes per element) for backward. Here one 64-bit ``random_`` call yields 64 / ``bits`` uniform
    integer draws; an element is kept when its draw clears a threshold, so the drop probability is
    round(p * 2**bits) / 2**bits. 16 bits: the scale is 1 / (1 - that probability), so every element keeps
    its expectation exactly. 32 bits: the probability is p to within 2**-33 and the scale is ``nn.Dropout``'s
    1 / (1 - p). p < 1.
    """
    n = shape.numel()
    per = 64 // bits
    span = 2 ** bits
    drop = min(round(p * span), span - 1)
    draws = torch.empty((n + per - 1) // per, dtype=torch.int64, device=device).random_(-(2**63), None)  # (n/per,)
    keep = draws.view(_INT[bits])[:n].view(shape) >= drop - span // 2  # (shape): uniform signed draws
    return keep, (span / (span - drop) if bits == 16 else 1.0 / (1.0 - p))


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


class _MaskMixin:
    """What the two fast modules share: how many bits a draw has, and whether this input gets torch's kernel."""

    bits: int = 32

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}"

    def torch_kernel(self, x: torch.Tensor) -> bool:
        """``F.dropout`` instead of the mask: under torch.compile (which fuses it), at p = 1 (everything
        dropped, as ``nn.Dropout`` does it), and for 32 bits off the CPU (torch's fused kernel is fast there)."""
        return (torch.compiler.is_compiling() or self.p >= 1.0
                or (self.bits == 32 and x.device.type != "cpu"))


class FastDropout(_MaskMixin, nn.Dropout):
    """``nn.Dropout`` (same p field, same state dict) with the cheaper mask of ``keep_mask``.

    Not the same draws as ``nn.Dropout``; ``torch.manual_seed`` reproduces the masks. ``bits``: 32 (p to
    within 2**-33) or 16 (p rounded to 2**-16). Identity in evaluation.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, bits: int = 32) -> None:
        super().__init__(p, inplace)
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.torch_kernel(x):
            return F.dropout(x, self.p, training=True)
        keep, scale = keep_mask(x.shape, self.p, x.device, self.bits)
        return _ScaleMask.apply(x, keep, scale)


class ReLUDropout(nn.Dropout):
    """dropout(relu(x)) with ``nn.Dropout``'s semantics. ``inplace=True``: for an input nothing else
    reads (a fresh linear output), the ReLU overwrites it instead of allocating another tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu_(x) if self.inplace else torch.relu(x)
        return F.dropout(r, self.p, self.training)


class FastReLUDropout(_MaskMixin, nn.Dropout):
    """dropout(relu(x)) in one step with ``FastDropout``'s mask: no ReLU input or mask kept for backward."""

    def __init__(self, p: float = 0.5, inplace: bool = False, *, bits: int = 32) -> None:
        super().__init__(p, inplace)
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or self.torch_kernel(x):
            r = torch.relu_(x) if self.inplace else torch.relu(x)
            return F.dropout(r, self.p, self.training)
        keep, scale = keep_mask(x.shape, self.p, x.device, self.bits)
        return _ReLUScaleMask.apply(x, keep, scale)


def dropout(config: ModelConfig, p: float, *, relu: bool = False) -> nn.Module:
    """The dropout module ``config.dropout_impl`` asks for; ``relu``: dropout(relu(x)) in place."""
    if config.dropout_impl == "torch":
        return ReLUDropout(p, inplace=True) if relu else nn.Dropout(p)
    bits = 16 if config.dropout_impl == "fast16" else 32
    return FastReLUDropout(p, inplace=True, bits=bits) if relu else FastDropout(p, bits=bits)
