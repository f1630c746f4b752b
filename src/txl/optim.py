"""Optimiser construction and the learning-rate schedules, as pure functions of the step."""

from __future__ import annotations

import math

import torch

from txl.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimiser step ``step`` (0-based) out of ``max_steps``.

    Warm-up rises linearly to cfg.lr over cfg.warmup_steps (the first step gets lr / warmup_steps);
    then 'cosine' decays to cfg.min_lr at max_steps (the original's CosineAnnealingLR), 'inv_sqrt' decays
    as lr * sqrt(warmup / step) (Vaswani et al. 2017), and 'constant' stays at lr.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "inv_sqrt":
        return cfg.lr * math.sqrt(cfg.warmup_steps / (step + 1))
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, capturable: bool = False) -> torch.optim.Optimizer:
    """Adam (the paper) or AdamW. Tied parameters appear once (parameters() deduplicates them).

    The fused implementation (one kernel over all parameters) is used where torch has it for the
    parameters' device: on CPU it steps the benchmark's 41M-parameter base model in ~33 ms instead of
    ~119 ms (``benchmarks/changes.py``). The update is the same formula.

    ``capturable``: safe to record in a CUDA graph (step counts and a tensor learning rate read on the device;
    ``txl.step_graph``); only where the parameters are on a GPU (torch has no capturable step on a CPU).
    """
    kind = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    params: list = list(model.parameters())
    compressor = getattr(model, "compressor", None)
    if compressor is not None and any(True for _ in compressor.parameters()):
        # Rae et al. 2020: the compression function learns from its own loss, in its own parameter group (clipped
        # on its own by train_step), so the main model's step is the one it would take without it.
        own = {id(p) for p in compressor.parameters()}
        params = [{"params": [p for p in params if id(p) not in own], "name": "model"},
                  {"params": list(compressor.parameters()), "name": "compression"}]
    options = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if capturable:
        options["capturable"] = True
    try:
        return kind(params, fused=True, **options)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return kind(params, **options)


def set_lr(optimizer: torch.optim.Optimizer, lr: float | torch.Tensor) -> None:
    """Every group's learning rate: a float, or a 0-d tensor on the device (a capturable optimiser reads it there)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
