"""How the model computes on a device type, decided anywhere: every choice that depends on the device, in one table.

A few ``ComputeConfig`` fields (and ``TrainConfig.precision``) leave a choice to the device the model runs on: 'auto'
values, and one default ('fast' dropout) whose sampler exists only on the CPU. A model resolves its compute config once
for the device its parameters live on (``compute_plan``, when it is built or moved) and its forward reads that
``ComputePlan``, never the device; a GPU and a CPU resolve from the same table. The ``ModelConfig`` (what the model
is, what a checkpoint stores) takes no part: a checkpoint loads under any plan.

``resolve(compute, device_type)`` replaces each of those values by what ``device_type`` would pick, so a model built
with the result takes that device's path wherever its tensors are: ``resolve(compute, "cuda")`` on the CPU runs
the static-shape adaptive softmax, the padded softmax widths and torch's dropout kernel
that CUDA runs (tests/test_cuda_rules.py runs it under CUDA's operand rules, ``txl.testing.cuda_rules``). Nothing
in a resolved config is 'auto' any more, except what does not depend on the device (below).

The interface (stable; other modules build on it):

* ``CHOICES``: the table, one ``Choice`` per device-dependent field value;
* ``resolved(field, value, device_type)``: one field's value as ``device_type`` resolves it (any other value as is);
* ``resolve(compute, device_type) -> ComputeConfig``: a validated copy with every device-dependent value resolved;
* ``resolve_precision(precision, device_type)``: ``TrainConfig.precision`` likewise ('auto' -> 'bf16' or 'fp32');
* ``compute_plan(compute, device_type) -> ComputePlan``: what a model's forward reads (the compute config with the
  table's choices made, and the SDPA pin below), resolved once for the device its parameters live on.
* ``fsdp_mixed_precision(precision, device_type)``: whether FSDP2 gathers bf16 parameters (``txl.parallel.shard``);
* ``resolved("graphs", "auto", device_type)``: ``TrainConfig.graphs`` ('auto' -> 'step' on CUDA, else 'off').

Not in the table, because the device does not decide them:

* ``cast_weights='auto'``: 'grouped' except in a process group of more than one (DDP's overlap of all-reduce and
  backward) or with parameters that are not plain tensors (FSDP's); decided per forward by the wrapper around the
  model, the same on every device, so ``resolve`` keeps it.
* ``cluster_rows`` under torch.compile: 'capacity' for 'selected' on every device (``nonzero``'s data-dependent
  shape breaks a graph).
* which SDPA kernel runs (``kernels.SDPA_BACKENDS``): a kernel choice inside one op, not an operand dtype; the CPU
  calls the op without the backend context only because the context costs time there (``ComputePlan.pin_sdpa``).
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
           why="'selected' is the least work but a host sync per cluster (nonzero) off the CPU; 'capacity' keeps "
               "shapes static (no sync, what CUDA graphs need) at about the same work"),
    Choice("softmax_pad", 0, cpu=1, cuda=64, other=1,
           why="tensor-core kernels need widths that are multiples of 64; on the CPU padding only adds work"),
    Choice("dropout_impl", "fast", cpu="fast", cuda="torch", other="torch",
           why="the gap sampler pays on the CPU only; elsewhere 'fast' runs torch's own kernel, which is 'torch'"),
    Choice("fsdp_mixed_precision", "bf16", cpu=False, cuda=True, other=False,
           why="TrainConfig.precision 'bf16' under FSDP2 (parallel.shard): bf16 parameters gathered and float32 "
               "gradients reduced on CUDA; elsewhere float32 parameters sharded, autocast casting them"),
    Choice("precision", "auto", cpu="fp32", cuda="bf16", other="fp32",
           why="bf16 autocast on a GPU that has bf16 tensor cores (Ampere and later: runtime.resolve_precision "
               "checks, else fp32); on a CPU bf16 pays only with AVX512_BF16 or AMX, so 'auto' never picks it"),
    Choice("graphs", "auto", cpu="off", cuda="step", other="off",
           why="TrainConfig.graphs: a CUDA graph replays the whole training step in one launch where the host "
               "otherwise launches every kernel (host-bound on a GPU); a CPU has no graphs to replay"),
)
"""Every device-dependent value, with its resolution per device type (the one place the forward reads them)."""

_BY_FIELD = {(c.field, c.value): c for c in CHOICES}


def _check_device_type(device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type {device_type!r} is unknown; choose one of {', '.join(DEVICE_TYPES)} (a "
                         "device's .type, e.g. torch.device('cuda:1').type == 'cuda')")


def resolved(field: str, value: Any, device_type: str) -> Any:
    """``field``'s ``value`` as a ``device_type`` device resolves it; a value that does not depend on the device, as is.

    What the forward calls with its tensors' ``device.type``: a type the table does not name ('meta', where tests
    read shapes) resolves as 'other'."""
    choice = _BY_FIELD.get((field, value))
    return value if choice is None else choice.on(device_type)


def resolve(compute: ComputeConfig, device_type: str) -> ComputeConfig:
    """A copy of ``compute`` with every device-dependent value replaced by what ``device_type`` picks (``CHOICES``).

    Build a model with it to run ``device_type``'s path on any device. ``resolve(resolve(c, d), e) == resolve(c, d)``
    for every d but 'cpu' (a config resolved for it no longer depends on the device); the CPU's gap sampler has no
    name of its own, so its resolution keeps 'fast', which means torch's kernel elsewhere.
    """
    _check_device_type(device_type)
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
    """How a model computes on the device type its parameters live on: resolved once, when the model is built or
    moved (``TransformerXL._apply``), from its ``ComputeConfig`` and ``CHOICES``, and read by the forward, which tests
    no device. The ``ModelConfig`` says what the model is (and is what a checkpoint stores); the plan only how, so a
    checkpoint loads under any plan and computes the same numbers up to rounding."""

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
    """Dropout draws the gaps between dropped elements (``dropout_impl='fast'`` where it pays: the CPU); else
    torch's kernel."""
    pin_sdpa: bool
    """SDPA runs inside the backend context that keeps cuDNN out (``kernels.SDPA_BACKENDS``); on the CPU, where
    there is no cuDNN and the context costs 20-40 us a call, the op is called as is."""


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
