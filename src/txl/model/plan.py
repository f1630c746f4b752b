"""How the model computes on a device type: every choice that depends on the device, in one table (``CHOICES``).

A few ``ComputeConfig`` fields (and ``TrainConfig.precision``, ``TrainConfig.graphs``) leave a choice to the device:
'auto' values, and 'fast' dropout, whose sampler exists only on the CPU. A model resolves its compute config once for
the device its parameters live on (``compute_plan``, when it is built or moved) and its forward reads that
``ComputePlan``, never the device. The ``ModelConfig`` (what a checkpoint stores) takes no part: a checkpoint loads
under any plan.

``resolve(compute, device_type)`` replaces each of those values by what ``device_type`` picks, so a model built with
the result takes that device's path anywhere: ``resolve(compute, "cuda")`` on the CPU runs CUDA's adaptive softmax,
padding and dropout (tests/test_cuda_rules.py). ``resolved(field, value, device_type)`` resolves one value;
``resolve_precision`` and ``fsdp_mixed_precision`` read ``TrainConfig.precision``.

Not in the table, because the device does not decide them: ``cast_weights='auto'`` (decided per forward, the same on
every device: ``txl.model.casting``), ``cluster_rows`` under torch.compile ('capacity' for 'selected' everywhere), and
which SDPA kernel runs (``ComputePlan.pin_sdpa`` only skips the backend context where it costs time: the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from txl.config import ComputeConfig

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""The device types the table knows; 'mps' and 'xpu' resolve as 'other' (no device-specific choice there yet)."""


@dataclass(frozen=True)
class Choice:
    """One device-dependent value of a field and what each device type makes of it."""

    field: str
    """The ``ComputeConfig`` field (or ``TrainConfig.precision``, ``TrainConfig.graphs``)."""
    value: Any
    """The value whose meaning depends on the device ('auto', or 'fast' for dropout)."""
    cpu: Any
    cuda: Any
    other: Any
    """What 'mps' and 'xpu' make of it."""
    why: str

    def on(self, device_type: str) -> Any:
        return getattr(self, device_type if device_type in ("cpu", "cuda") else "other")


CHOICES = (
    Choice("cluster_rows", "auto", cpu="selected", cuda="capacity", other="capacity",
           why="'selected' is the least work but a host sync per cluster off the CPU; 'capacity' keeps shapes static"),
    Choice("softmax_pad", 0, cpu=1, cuda=64, other=1,
           why="tensor-core kernels need widths that are multiples of 64; on the CPU padding only adds work"),
    Choice("dropout_impl", "fast", cpu="fast", cuda="torch", other="torch",
           why="the gap sampler pays on the CPU only; elsewhere 'fast' runs torch's own kernel, which is 'torch'"),
    Choice("fsdp_mixed_precision", "bf16", cpu=False, cuda=True, other=False,
           why="FSDP2 with bf16: bf16 parameters gathered, float32 gradients reduced on CUDA; elsewhere autocast"),
    Choice("precision", "auto", cpu="fp32", cuda="bf16", other="fp32",
           why="bf16 on a GPU with bf16 tensor cores (runtime.resolve_precision checks); a CPU gains only with AMX"),
    Choice("graphs", "auto", cpu="off", cuda="step", other="off",
           why="a CUDA graph replays the training step in one launch (a GPU step is host-bound); a CPU has none"),
)
"""Every device-dependent value, with its resolution per device type (the one place the forward reads them)."""

_BY_FIELD = {(c.field, c.value): c for c in CHOICES}


def resolved(field: str, value: Any, device_type: str) -> Any:
    """``field``'s ``value`` as a ``device_type`` device resolves it (a type the table does not name, e.g. 'meta', as
    'other'); a value that does not depend on the device, as is."""
    choice = _BY_FIELD.get((field, value))
    return value if choice is None else choice.on(device_type)


def resolve(compute: ComputeConfig, device_type: str) -> ComputeConfig:
    """A copy of ``compute`` with every device-dependent value replaced by what ``device_type`` picks (``CHOICES``):
    build a model with it to run ``device_type``'s path on any device. Resolving again changes nothing, except after
    'cpu', whose gap sampler has no name of its own: it keeps 'fast', which is torch's kernel elsewhere."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type {device_type!r} is unknown; choose one of {', '.join(DEVICE_TYPES)} (a "
                         "device's .type, e.g. torch.device('cuda:1').type == 'cuda')")
    if not isinstance(compute, ComputeConfig):  # a ModelConfig has none of the fields: it would resolve to itself
        raise TypeError(f"plan.resolve takes a ComputeConfig, not a {type(compute).__name__}: build the model with "
                        "TransformerXL(config, plan.resolve(ComputeConfig(), device_type))")
    changes = {c.field: c.on(device_type) for c in CHOICES
               if hasattr(compute, c.field) and getattr(compute, c.field) == c.value}
    return compute.replace(**changes)


def fsdp_mixed_precision(precision: str, device_type: str) -> bool:
    """Whether FSDP2 shards with a bf16 ``MixedPrecisionPolicy`` (``txl.parallel.shard``) for this precision."""
    return precision == "bf16" and resolved("fsdp_mixed_precision", precision, device_type)


def resolve_precision(precision: str, device_type: str) -> str:
    """``TrainConfig.precision`` as ``device_type`` resolves it: 'auto' -> 'bf16' on CUDA (one that supports it:
    ``runtime.resolve_precision`` asks the device), else 'fp32'; an explicit precision as is."""
    return resolved("precision", precision, device_type)


@dataclass(frozen=True)
class ComputePlan:
    """How a model computes on the device type its parameters live on: resolved when the model is built or moved
    (``TransformerXL._apply``) from its ``ComputeConfig`` and ``CHOICES``, and read by the forward."""

    device_type: str
    """The device type it was resolved for (a type the table does not name resolves as 'other')."""
    attn_impl: str
    """'fused' (the fast path) or 'reference' (the plain path, ``txl.model.plain``)."""
    recompute_attention: bool
    """Training's fused attention recomputes its scores in backward instead of keeping the probabilities."""
    cast_weights: str
    """'auto', 'per_use' or 'grouped': how the weights reach autocast's dtype (decided per forward, not here)."""
    cluster_rows: str
    """'selected', 'capacity' or 'all': which rows each tail cluster of the adaptive input and softmax computes."""
    softmax_pad: int
    """The multiple each output matmul's width of the softmax is padded to (1: none)."""
    gap_dropout: bool
    """Dropout draws the gaps between dropped elements (``dropout_impl='fast'`` on the CPU), else torch's kernel."""
    pin_sdpa: bool
    """SDPA runs inside the backend context that keeps cuDNN out (``kernels.SDPA_BACKENDS``); not on the CPU."""


def compute_plan(compute: ComputeConfig, device_type: str) -> ComputePlan:
    """The ``ComputePlan`` of ``compute`` on a ``device_type`` device (any type: 'meta' resolves as 'other')."""
    return ComputePlan(device_type=device_type, attn_impl=compute.attn_impl,
                       recompute_attention=compute.recompute_attention, cast_weights=compute.cast_weights,
                       cluster_rows=resolved("cluster_rows", compute.cluster_rows, device_type),
                       softmax_pad=resolved("softmax_pad", compute.softmax_pad, device_type),
                       gap_dropout=resolved("dropout_impl", compute.dropout_impl, device_type) == "fast",
                       pin_sdpa=device_type != "cpu")


__all__ = ["CHOICES", "DEVICE_TYPES", "Choice", "ComputePlan", "compute_plan", "fsdp_mixed_precision", "resolve",
           "resolve_precision", "resolved"]
