"""One training step's figures (``txl.train.train_step`` returns them; ``txl.step_graph`` reads them from its
buffers), and reading many of them from the device at once. Apart from ``txl.train`` so that the captured step,
which ``txl.train`` builds, needs nothing from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepStats:
    """One step's figures. As ``train_step`` returns them, loss, tokens and grad_norm are 0-d tensors on the
    device: reading one is a host sync (the host waits for the step to finish), so the trainer reads a log
    interval's steps at once (``read_stats``)."""

    loss: float | torch.Tensor
    tokens: int | torch.Tensor
    lr: float
    grad_norm: float | torch.Tensor
    compression_loss: float | torch.Tensor | None = None
    """cmem_len > 0, 'conv': the attention-reconstruction loss (Rae et al. 2020), mean over chunks and processes."""


def read_stats(steps: list[StepStats]) -> list[StepStats]:
    """The steps' figures as Python numbers, read from the device in one transfer (one host sync)."""
    tensors = [v.detach().double().reshape(()) for s in steps
               for v in (s.loss, s.tokens, s.grad_norm, s.compression_loss) if isinstance(v, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else ())

    def read(v: float | int | torch.Tensor | None) -> float | None:
        return next(values) if isinstance(v, torch.Tensor) else v

    out = []
    for s in steps:
        loss, tokens, grad_norm, aux = read(s.loss), read(s.tokens), read(s.grad_norm), read(s.compression_loss)
        out.append(StepStats(float(loss), int(tokens), s.lr, float(grad_norm), None if aux is None else float(aux)))
    return out
