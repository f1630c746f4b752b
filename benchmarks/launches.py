"""What one training or evaluation step asks of a device, counted on the CPU: launched ops, copies, host syncs.

A GPU runs what the host launches: every aten op that is not a view is a kernel launch, and every
``.item()``, ``int(tensor)`` or ``nonzero`` is a host sync (the host waits for the device's queue to drain).
Both are properties of the code, not of the device, so they are counted here on a CPU, at narrow widths
with the layers and clusters of the shape that matters (NVIDIA's WikiText-103 base: 16 layers, 3 tail
clusters, bf16 autocast), and held under ceilings in tests/test_launches.py (STYLE.md 21).

Two instruments, each where it sees what a GPU would do:

* a dispatch mode (``TorchDispatchMode``) sees each op as the dispatcher hands it to a kernel, after autocast
  and autograd (so autocast's casts and backward's ops are there) and before a CPU kernel's own internals:
  ``launched`` counts those ops that are not views or allocations, ``copies`` the ``_to_copy``, ``copy_`` and
  ``clone`` among them (one copy kernel each on a GPU), ``cats`` the ``cat``. Not seen, so not counted: what a
  CPU kernel does inside (its mixed-dtype elementwise ops copy their inputs first; a CUDA kernel casts as it
  reads), which the profiler's ``aten::copy_`` rows include;
* torch.profiler sees every op at any depth: ``syncs`` counts ``_local_scalar_dense`` (what ``.item()``,
  ``int()`` and ``float()`` of a tensor run) and ``nonzero`` (its output's size is read back), also inside
  composite ops (indexing with a bool mask runs ``nonzero``). Beneath the fused Adam step nothing is counted:
  on CUDA ``_fused_adam_`` reads the step counts on the device, while the CPU kernel reads each parameter's
  with ``item()``, syncs a GPU does not make.

    python -m benchmarks.launches              # train and eval, bf16 autocast and fp32, as on this CPU
    python -m benchmarks.launches --cuda-mode  # and the train step in the mode a GPU runs (no syncs there)
    python -m benchmarks.launches --device cuda  # the same counts on a GPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import txl
from txl.config import OptimConfig
from txl.data.iterator import Batch
from txl.distributed import DistInfo
from txl.optim import build_optimizer
from txl.train import train_step

CPU = torch.device("cpu")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
"""Ops that make the host wait for the device (profiler names)."""
OPAQUE = ("aten::_fused_adam_", "aten::_fused_adamw_")
"""Ops beneath which the profiler's syncs are not counted (see the module docstring)."""
COPY_OPS = ("aten::_to_copy", "aten::copy_", "aten::clone")
"""Ops that launch a copy kernel (dispatch names)."""
FREE_OPS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
            "aten::resize_", "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::set_", "aten::_unsafe_view",
            "aten::is_nonzero", "aten::result_type", "aten::sym_size", "aten::sym_stride", "aten::sym_numel",
            "aten::sym_storage_offset", "aten::is_same_size",
            "aten::_record_function_enter_new", "aten::_record_function_exit"}
"""Ops that launch no kernel: allocations, metadata, and the profiler's markers (torch.optim wraps each step and
zero_grad in a ``record_function``: counted as 4 launches of a train step before s34)."""


def narrow_nvidia(**changes) -> txl.ModelConfig:
    """NVIDIA's WikiText-103 base structure (16 layers, adaptive softmax with 3 tail clusters, div_val 1, tied
    weights) at widths a CPU counts in a second: d_model 64, 2 heads of 32, vocabulary 2,677 cut at 200, 400,
    2,000 (NVIDIA's 267,735 cut at 20,000, 40,000, 200,000, divided by 100)."""
    fields = dict(vocab_size=2677, cutoffs=[200, 400, 2000], div_val=1, n_layer=16, d_model=64, n_head=2, d_head=32,
                  d_inner=128, mem_len=24, dropout=0.1)
    return txl.ModelConfig(**{**fields, **changes})


def zipf_tokens(vocab_size: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Token ids drawn p ~ 1/rank (running text), so every cluster of an adaptive softmax is met."""
    p = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return torch.multinomial(p, int(torch.tensor(shape).prod()), replacement=True, generator=generator).view(shape)


@dataclasses.dataclass
class Counts:
    """Op counts of one step (``count``)."""

    ops: collections.Counter
    """Every aten op the dispatcher handed to a kernel, by name, views included."""
    launched: int
    """Of those, the ops that are not views or allocations: kernel launches on a GPU."""
    syncs: collections.Counter
    """Host syncs by profiler name (``SYNC_OPS``), at any depth."""

    @property
    def copies(self) -> int:
        return sum(self.ops[n] for n in COPY_OPS)

    @property
    def cats(self) -> int:
        return self.ops["aten::cat"]

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())

    def row(self) -> dict:
        return dict(launched=self.launched, copies=self.copies, cat=self.cats, syncs=self.n_syncs,
                    **{n.removeprefix("aten::"): self.syncs[n] for n in SYNC_OPS})


class _Dispatched(TorchDispatchMode):
    """Counts the ops handed to kernels, and the non-view, non-allocation ones among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launched = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten::{func._opname}"
        self.ops[name] += 1
        self.launched += not (func.is_view or name in FREE_OPS)
        return func(*args, **(kwargs or {}))


def count(fn) -> Counts:
    """Run ``fn()`` twice, once under each instrument, and count its ops (see the module docstring): the steps
    must be alike (a step with a full memory, a segment with a full memory). Apart, so that neither instrument
    changes what the other sees (a Python dispatch mode sends some CPU kernels down paths that read scalars)."""
    from torch.profiler import ProfilerActivity, profile

    with _Dispatched() as mode:
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    syncs = collections.Counter(e.name for e in prof.events() if e.name in SYNC_OPS and not _inside(e, OPAQUE))
    return Counts(ops=mode.ops, launched=mode.launched, syncs=syncs)


def _inside(event, names: tuple[str, ...]) -> bool:
    """Whether a profiler event runs beneath an op named in ``names``."""
    p = event.cpu_parent
    while p is not None:
        if p.name in names:
            return True
        p = p.cpu_parent
    return False


def train_counts(config: txl.ModelConfig, compute: txl.ComputeConfig | None = None, *, precision: str = "bf16",
                 batch: int = 4, tgt_len: int = 24, seed: int = 0, device: torch.device = CPU) -> Counts:
    """The counts of one ``txl.train.train_step`` (forward, backward, clip, fused Adam), memory carried from a
    first, uncounted step (the second sees a full memory when tgt_len >= mem_len, as every step after it)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = txl.TransformerXL(config, compute).to(device).train()
    optimizer = build_optimizer(model, OptimConfig(lr=2.5e-4))
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    info = DistInfo(rank=0, world_size=1, device=device)
    stream = zipf_tokens(config.vocab_size, (batch, 2 * tgt_len + 1), gen).to(device)  # (B, 2T + 1)
    memories = [None]

    # The batches made before the steps (as the data iterator hands them over): their copies are not the step's.
    batches = [Batch(input_ids=stream[:, i * tgt_len:(i + 1) * tgt_len].contiguous(),
                     labels=stream[:, i * tgt_len + 1:(i + 1) * tgt_len + 1].contiguous(), context_len=0,
                     start=i * tgt_len) for i in range(2)]

    def step(i: int) -> None:
        nonlocal memories
        _, memories = train_step(model, optimizer, scaler, batches[i], memories, lr=2.5e-4, clip=0.25,
                                 precision=precision, info=info)

    step(0)
    return count(lambda: step(1))  # each count runs step 1 again: the same full memory, the same shapes


def eval_counts(config: txl.ModelConfig, compute: txl.ComputeConfig | None = None, *, precision: str = "bf16",
                batch: int = 4, tgt_len: int = 8, mem_len: int = 80, seed: int = 0,
                device: torch.device = CPU) -> Counts:
    """The counts of one evaluation segment as ``txl.evaluate`` runs it (no_grad, memory and key/value cache
    carried) once the memory is full (NVIDIA's evaluation geometry: short segments, long memory)."""
    from txl.evaluate import autocast

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = txl.TransformerXL(config, compute).to(device).eval()
    ctx = config.context(mem_len=mem_len)
    n = mem_len // tgt_len + 1
    stream = zipf_tokens(config.vocab_size, (batch, (n + 1) * tgt_len + 1), gen).to(device)
    state = dict(memory=None, cache=model.start_kv_cache())

    @torch.no_grad()
    def segment(i: int) -> None:
        x, y = stream[:, i * tgt_len:(i + 1) * tgt_len], stream[:, i * tgt_len + 1:(i + 1) * tgt_len + 1]
        with autocast(device, precision):
            out = model(x, labels=y, memory=state["memory"], kv_cache=state["cache"], context=ctx)
        state.update(memory=out.memory, cache=out.kv_cache)

    for i in range(n):
        segment(i)
    return count(lambda: segment(n))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a ModelConfig field of the narrow NVIDIA-structured model (e.g. --model mem_len 48)")
    p.add_argument("--compute", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a ComputeConfig field (e.g. --compute attn_impl reference)")
    p.add_argument("--cuda-mode", action="store_true", help="also the rows in the mode a GPU runs (on a CPU)")
    p.add_argument("--device", default="cpu", help="count on this device (cuda: the real thing, no emulation needed)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    config = narrow_nvidia(**{k: _parse(v) for k, v in args.model})
    compute = txl.ComputeConfig(**{k: _parse(v) for k, v in args.compute})
    print(f"device {device}")
    print("phase  precision  launched  copies  cat  syncs  _local_scalar_dense  nonzero")
    for phase, fn in (("train", train_counts), ("eval", eval_counts)):
        for precision in ("bf16", "fp32"):
            r = fn(config, compute, precision=precision, device=device).row()
            print(f"{phase:6} {precision:9} {r['launched']:9} {r['copies']:7} {r['cat']:4} {r['syncs']:6} "
                  f"{r['_local_scalar_dense']:20} {r['nonzero']:8}")
    if args.cuda_mode:
        cuda = compute.replace(dropout_impl="torch", cluster_rows="all")  # the 'auto's as CUDA resolves them
        for phase, fn in (("train", train_counts), ("eval", eval_counts)):
            with as_on_cuda():
                r = fn(config, cuda).row()
            print(f"{phase} bf16 as on CUDA (dropout_impl torch, fused dropout, cluster_rows all, ids not read): "
                  f"{r}")
        for phase, fn in (("train", train_counts), ("eval", eval_counts)):
            with as_on_cuda(dropout=False):
                r = fn(config, cuda).row()
            print(f"{phase} bf16 as on CUDA but dropout decomposed as on the CPU (the count before i34more): {r}")


def as_on_cuda(dropout: bool = True):
    """A context in which the model runs what it runs on a GPU: it reads no token values (``reads_values``; before
    issue 34 the model read them on every device, so nothing is changed there), and, with ``dropout``,
    ``F.dropout`` in training is torch's fused ``native_dropout`` (one kernel forward, one backward), as
    ``at::dropout`` picks it for a CUDA tensor, where on a CPU tensor it decomposes into bernoulli_, div_ and mul
    (three launches forward). Other draws than the CPU's, the same ops as a GPU's."""
    import contextlib
    from unittest import mock

    import torch.nn.functional as F

    import txl.model.transformer as transformer

    stack = contextlib.ExitStack()
    if hasattr(transformer, "reads_values"):
        stack.enter_context(mock.patch.object(transformer, "reads_values", lambda t: False))
    if dropout:
        cpu_dropout = F.dropout

        def fused(input, p=0.5, training=True, inplace=False):
            if training and 0 < p < 1 and input.numel():
                return torch.native_dropout(input, p, True)[0]
            return cpu_dropout(input, p, training, inplace)

        stack.enter_context(mock.patch.object(F, "dropout", fused))
    return stack


def _parse(value: str):
    import json

    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


if __name__ == "__main__":
    main()
