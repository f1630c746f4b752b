"""How the model is shared over the processes of a torchrun job: DDP or FSDP2, on PyTorch's own engine.

* ``ddp``: every process holds the whole model; DistributedDataParallel all-reduces the gradients.
* ``fsdp``: ``torch.distributed.fsdp.fully_shard`` (FSDP2) shards each decoder layer, then the embedding
  and the adaptive softmax (one unit when they share weights, ``tie_weight``), then the root (the biases
  u, v and what is left), the order torchtitan applies it in. Parameters, gradients and optimiser state
  are sharded (``DTensor``); a unit's full weights exist only while it runs. On a GPU with bf16 a
  ``MixedPrecisionPolicy`` computes in bf16 and reduces gradients in fp32.
* activation checkpointing (either mode) wraps each decoder layer in torch's ``checkpoint_wrapper``, so
  its activations are recomputed in the backward pass instead of kept.

The model itself knows nothing of this (torchtitan's rule). Each process keeps the memory of its own
streams, exactly as under DDP (Dai et al. 2019, section 3.2: the memory is per-stream state).

The checkpoint side: ``state_dicts``/``load_state_dicts`` are torch.distributed.checkpoint.state_dict's
``get_state_dict``/``set_state_dict``, which give every parallel form the same keys (those of
``TransformerXL.state_dict()``), so a sharded checkpoint (txl.checkpoint) loads at any process count.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from txl.distributed import DistInfo
from txl.model import plan

log = logging.getLogger(__name__)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` (its class is then an FSDPModule)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def checkpoint_layers(model: nn.Module) -> None:
    """Wrap each decoder layer so its activations are recomputed in backward (torch's checkpoint_wrapper:
    the non-reentrant checkpoint, RNG state replayed, so dropout masks and results are the same).
    The wrapper's state-dict hooks keep the parameter names unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)


def shared_parameters(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold a parameter in common (tied embedding and softmax weights)."""
    ids = {id(p) for p in a.parameters()}
    return any(id(p) in ids for p in b.parameters())


def shard(model: nn.Module, info: DistInfo, *, precision: str, device_type: str | None = None) -> None:
    """Apply FSDP2 to ``model`` in place: each decoder layer, then embedding and softmax, then the root.
    ``device_type``: the device whose path to take (``txl.model.plan``: a test runs CUDA's on the CPU); None:
    ``info.device``'s."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # FSDP2 became public in torch 2.6; txl's core runs on older releases
        raise ValueError(f"--train.parallel fsdp needs torch >= 2.6 (FSDP2's fully_shard); this is torch "
                         f"{torch.__version__}: upgrade torch, or use --train.parallel ddp") from None

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kw: dict[str, Any] = {"mesh": mesh}
    if plan.fsdp_mixed_precision(precision, device_type or info.device.type):  # bf16 compute, fp32 reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # FSDP2 warns that a unit returns a view (the memory, the NLL); only an in-place op on it would lose a
    # hook, and no caller modifies the model's outputs in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in model.layers:
        fully_shard(layer, **kw)
    if shared_parameters(model.embed, model.softmax):  # a parameter belongs to exactly one unit
        fully_shard([model.embed, model.softmax], **kw)
    else:
        fully_shard(model.embed, **kw)
        fully_shard(model.softmax, **kw)
    fully_shard(model, **kw)
    if model.config.cutoffs:
        # A tail cluster no token of a process's shard falls in would get no gradient there, and the processes
        # would reduce-scatter different tensors: every cluster runs (on no rows, a zero gradient) instead. (DDP:
        # find_unused_parameters. torch 2.13's set_reduce_scatter_unused_params does this inside FSDP; older
        # FSDP2 releases have no such option.)
        model.embed.every_cluster = model.softmax.every_cluster = True


def wrap(model: nn.Module, info: DistInfo, *, parallel: str, activation_checkpointing: bool,
         precision: str, device_type: str | None = None) -> nn.Module:
    """The module the training step calls: ``model`` itself (one process; FSDP, which shards it in place)
    or its DDP wrapper. Activation checkpointing is applied first, inside either. ``device_type``: ``shard``'s."""
    if activation_checkpointing:
        checkpoint_layers(model)
    if not info.enabled:
        return model
    if parallel == "fsdp":
        shard(model, info, precision=precision, device_type=device_type)
        return model
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
        find_unused_parameters=bool(model.config.cutoffs))  # an unseen cluster gets no gradient


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate this backward's gradients locally, without communicating (all chunks but the last)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm`` (inf: only measure it) and return the norm before,
    a 0-d tensor on the device (read it when needed: reading is a host sync).

    With sharded (DTensor) gradients the norm of the local shards is reduced over the processes first
    (torchtitan's way); otherwise this is ``torch.nn.utils.clip_grad_norm_``, unchanged.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        if not math.isfinite(max_norm):  # only measure: scaling by min(1, inf / norm) = 1 took 5 launches for nothing
            return torch.nn.utils.get_total_norm(grads)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the norm over every shard of every process
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def all_finite(model: nn.Module, info: DistInfo) -> bool:
    """Whether every weight of every process is finite (each process checks its own shards)."""
    from torch.distributed.tensor import DTensor

    from txl.distributed import any_true

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    bad = not all(bool(torch.isfinite(p).all()) for p in local)
    return not (any_true(bad, info) if is_sharded(model) else bad)


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """The whole weights in place for a while (evaluation, sampling): FSDP units are all-gathered once and
    kept until the end, so code that reads a layer's weights outside its forward (the evaluation's KV
    cache) works as it does unsharded. Every process must enter it (it communicates). No-op otherwise."""
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


# -- state dicts for checkpoints ----------------------------------------------------------------------

def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimiser's state dicts keyed by parameter names (sharded DTensors under FSDP)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                     optim_state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)

