"""The changes of issue 34, each switchable back to before it inside one benchmark worker: one GPU lease, an A/B.

``python -m benchmarks.run --before sdpa-pin ...`` runs its workers with that change undone (``benchmarks.gpu_session``
runs each phase with and without every switch). A switch undoes its change for the duration of a ``before``
block in the worker process, by a ModelConfig or ComputeConfig field (``model``) or by putting the earlier function back
(``patch``); nothing is changed in the library for it. The whole earlier tree is the other way to compare
(``gpu_session --baseline-src``): it needs no switch, but it cannot isolate one change.

Another change of the issue (the model-side ones) becomes one more entry of ``SWITCHES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Switch:
    what: str
    """The change, in a few words."""
    model: dict[str, object] = field(default_factory=dict)
    """ModelConfig or ComputeConfig fields that give the behaviour before the change."""
    patch: Callable[[], contextlib.AbstractContextManager] | None = None
    """A context that puts the earlier code back while it is open."""


@contextlib.contextmanager
def _unpinned_sdpa() -> Iterator[None]:
    """Before ``kernels.sdpa``'s pin: SDPA chooses among all its kernels (cuDNN first for a dense bias on sm90)."""
    import torch.nn.functional as F

    from txl.model import kernels

    pinned = kernels.sdpa

    def sdpa(query, k, val, attn_mask, scale=1.0, pin=True):
        return F.scaled_dot_product_attention(query, k, val, attn_mask=attn_mask, scale=scale)

    kernels.sdpa = sdpa
    try:
        yield
    finally:
        kernels.sdpa = pinned


SWITCHES: dict[str, Switch] = {
    "sdpa-pin": Switch("SDPA pinned to flash / memory-efficient / math (no cuDNN plan per shape)",
                       patch=_unpinned_sdpa),
    # The model-side changes, each a (ModelConfig's until issue 45, ComputeConfig's since) field whose old value gives
    # the behaviour at a4a52e2.
    "cluster-rows": Switch("adaptive clusters on static-shape rows (no nonzero sync per cluster)",
                           model={"cluster_rows": "selected"}),
    # Issue 45 item 4: the tails' fixed-capacity rows in place of scoring every row against every tail ('all', the
    # GPU's choice until then: 2.42x a step's FLOPs at NVIDIA's shape).
    "cluster-capacity": Switch("each tail cluster scoring a fixed capacity of rows, not every row",
                               model={"cluster_rows": "all"}),
    "softmax-pad": Switch("output matmul widths padded to multiples of 64", model={"softmax_pad": 1}),
    "cast-weights": Switch("the layers' weights cast in one op per forward, their gradients back in one",
                           model={"cast_weights": "per_use"}),
    # Issue 45 removed state-dtype (train 1.00x) and residual-dtype (train 85,159 against 84,855 tokens/s) with
    # their ModelConfig fields: docs/gpu-runs/2026-11-28-h200-dac89e9.
}


def available() -> list[str]:
    """The switches this txl has: those whose fields exist (all of them once the changes are in)."""
    import txl.config

    fields = {name for kind in ("ModelConfig", "ComputeConfig")
              for name in getattr(getattr(txl.config, kind, None), "__dataclass_fields__", ())}
    return [name for name, switch in SWITCHES.items() if set(switch.model) <= fields]


def model_fields(names: list[str]) -> dict[str, object]:
    """The fields the named switches set back; a switch this txl lacks is refused in one line."""
    missing = [name for name in names if name not in available()]
    if missing:
        raise SystemExit(f"--before {' '.join(missing)}: this txl's ModelConfig and ComputeConfig lack "
                         f"{', '.join(f for name in missing for f in SWITCHES[name].model)}; the switches here: "
                         f"{', '.join(available())}")
    out: dict[str, object] = {}
    for name in names:
        out.update(SWITCHES[name].model)
    return out


@contextlib.contextmanager
def before(names: list[str]) -> Iterator[None]:
    """The named changes undone (their patches) while the block runs; ``model_fields`` gives their config."""
    with contextlib.ExitStack() as stack:
        for name in names:
            if SWITCHES[name].patch is not None:
                stack.enter_context(SWITCHES[name].patch())
        yield
