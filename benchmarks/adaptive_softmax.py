"""The adaptive softmax's rows (``ComputeConfig.cluster_rows``) side by side at NVIDIA's WikiText-103 shape, counted
on the CPU: the FLOPs of a training step against the FLOP model, and the softmax's peak memory.

    python -m benchmarks.adaptive_softmax              # NVIDIA's shape ('selected' computes for real: a minute)
    python -m benchmarks.adaptive_softmax --scale 8    # vocabulary and cutoffs 8x smaller (seconds)
    python -m benchmarks.adaptive_softmax --wikitext2 ../shared/data/wikitext-2   # and WikiText-2's rows from its data

One table, a row per ``cluster_rows`` (the softmax as CUDA's plan computes it: widths padded to 64; float32):

* the adaptive softmax alone, (N, d) hidden states to the summed NLL of Zipf-distributed labels and back: its FLOPs
  (``torch.utils.flop_counter.FlopCounterMode``) and peak memory (``torch.distributed._tools.mem_tracker.MemTracker``:
  the bytes of live tensors, the weights and their gradients included, at their most); 'selected' and 'capacity'
  computed, 'all' on fake tensors (``FakeTensorMode``: shapes only; its logits alone are 6 GB here). The rest of a
  step is the same in every mode and the softmax runs last forward and first backward: a step's peak differs by
  what the softmax's does;
* the FLOP model of ``benchmarks.flops`` (the tails at their Zipf shares) with its softmax term replaced by the
  softmax's counted FLOPs (how issue 45 measured 'all' at 2.42x);
* a whole training step (forward with a full memory, backward; dropout 0, which adds no FLOPs) counted on fake
  tensors; 'selected' cannot run on them (``nonzero`` reads values): its step is 'capacity''s with the softmax's
  count swapped for 'selected''s.

With ``--wikitext2 DIR`` a second table: WikiText-2's training split (word level, 33,278 words in frequency order,
cutoffs [2000, 4000, 20000]) in NVIDIA's batches (32 streams of 192), the model NVIDIA's otherwise: 'capacity''s rows
from the Zipf estimate (which the worst batch overflows) and from the split's own counts (``tail_counts``, the rows
``txl.train`` sets), each against 'selected' on the split's first batch and the FLOP model at that vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

import txl
from benchmarks.flops import SHAPES, Shape, flops_per_token, softmax_params, token_probs
from benchmarks.run import model_config
from txl.model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax

ROWS = ("selected", "capacity", "all")


def scaled(shape: Shape, scale: int, d_model: int | None = None) -> Shape:
    """``shape`` with the vocabulary and the cutoffs ``scale`` times smaller (the tails' Zipf shares nearly the same:
    they go with the log of the cutoffs' ratios), the labels of a step as many, and d_model if given."""
    return dataclasses.replace(shape, vocab_size=shape.vocab_size // scale, d_model=d_model or shape.d_model,
                               cutoffs=tuple(c // scale for c in shape.cutoffs))


def as_on_cuda(model: torch.nn.Module, rows: str) -> torch.nn.Module:
    """``model``'s adaptive modules computing ``rows`` with the softmax widths padded to 64, as CUDA's plan sets them
    (``txl.model.plan``)."""
    for module in model.modules():
        if isinstance(module, (AdaptiveEmbedding, AdaptiveLogSoftmax)):
            module.rows = rows
        if isinstance(module, AdaptiveLogSoftmax):
            module.pad = 64
    return model


def step_flops(shape: Shape, rows: str) -> int:
    """FLOPs of one training step (forward with labels and a full memory, backward) of the whole model, counted on
    fake tensors. The input checks read token values, which fake tensors have none of: skipped, as on a GPU."""
    B, T, M = shape.batch, shape.tgt_len, shape.mem_len
    with FakeTensorMode(), mock.patch("txl.model.transformer.reads_values", lambda t: False):
        model = as_on_cuda(txl.TransformerXL(model_config(shape, dropout=0.0)), rows)
        ids = torch.zeros(B, T, dtype=torch.long)
        memory = [torch.zeros(B, M, shape.d_model) for _ in range(shape.n_layer)]
        with FlopCounterMode(display=False) as counter:
            model(ids, labels=ids, memory=memory).loss.backward()
    return counter.get_total_flops()


def labels(shape: Shape, seed: int = 0) -> torch.Tensor:
    """(N,) Zipf-distributed labels for one training step of ``shape`` (N = B T)."""
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(token_probs(shape).float(), shape.batch * shape.tgt_len, replacement=True, generator=g)


def softmax_cost(shape: Shape, rows: str, target: torch.Tensor, fake: bool = False,
                 caps: list[int] | None = None) -> tuple[int, int]:
    """(FLOPs, peak bytes) of the adaptive softmax alone: (N, d) hidden states to the summed NLL of ``target``, and
    backward to the hidden states and the weights. On fake tensors (``fake``) nothing is computed. ``caps``: the
    tails' 'capacity' rows fitted to data (``fit_capacity``); None, the Zipf estimate."""
    n = target.numel()
    with FakeTensorMode() if fake else contextlib.nullcontext():
        softmax = as_on_cuda(AdaptiveLogSoftmax(model_config(shape)), rows)
        if caps is not None:
            softmax.fit_capacity(caps)
        hidden = torch.zeros(n, shape.d_model, requires_grad=True)
        target = torch.zeros(n, dtype=torch.long) if fake else target  # values unread by 'capacity' and 'all'
        tracker = MemTracker()
        tracker.track_external(softmax, hidden)
        with tracker, FlopCounterMode(display=False) as counter:
            softmax.nll(hidden, target).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return counter.get_total_flops(), peak


def wikitext2_table(directory: str) -> None:
    """The second table (the module docstring): WikiText-2's 'capacity' rows, Zipf's and its own."""
    from txl.config import DataConfig
    from txl.data import OrderedIterator
    from txl.data.corpora import load_run_corpus
    from txl.model.adaptive import cluster_of

    corpus = load_run_corpus(DataConfig(corpus="wt2", data_dir=directory))
    shape = dataclasses.replace(SHAPES["nvidia"], vocab_size=corpus.vocab_size, cutoffs=(2000, 4000, 20000))
    it = OrderedIterator(corpus.train, batch_size=shape.batch, tgt_len=shape.tgt_len)
    counts, first = it.tail_counts(list(shape.cutoffs)), next(iter(it)).labels.reshape(-1)  # (N,)
    zipf_rows = as_on_cuda(AdaptiveLogSoftmax(model_config(shape)), "capacity").capacities(first.numel())
    fitted = as_on_cuda(AdaptiveLogSoftmax(model_config(shape)), "capacity")
    fitted.fit_capacity(counts)
    in_first = torch.bincount(cluster_of(first, list(shape.cutoffs)), minlength=4).tolist()
    print(f"\nWikiText-2 train ({len(corpus.train):,} tokens, V {shape.vocab_size:,}, cutoffs {list(shape.cutoffs)}) "
          f"in batches of {shape.batch} x {shape.tgt_len}: the worst batch's labels per tail {counts}; the first "
          f"batch's per cluster {in_first}; 'capacity' rows per tail: Zipf {zipf_rows}, from the data {fitted.caps}")
    tokens = shape.batch * shape.tgt_len
    formula = flops_per_token(shape, "train") * tokens
    body = formula - 6 * softmax_params(shape) * tokens
    soft = {"selected (first batch)": softmax_cost(shape, "selected", first),
            "capacity, Zipf rows (the worst batch overflows)": softmax_cost(shape, "capacity", first),
            "capacity, rows from the data": softmax_cost(shape, "capacity", first, caps=counts)}
    print("\n| WikiText-2, cluster_rows | softmax TFLOP | formula, its softmax counted | / formula | "
          "softmax / 'selected''s | softmax peak MB | / 'selected' |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = soft["selected (first batch)"]
    for rows, (flop, peak) in soft.items():
        print(f"| {rows} | {flop / 1e12:.3f} | {(body + flop) / 1e12:.3f} | {(body + flop) / formula:.3f} | "
              f"{flop / base[0]:.3f} | {peak / 2**20:,.0f} | {peak / base[1]:.3f} |")
    print(f"\nformula (benchmarks.flops, train, Zipf shares at V {shape.vocab_size:,}): {formula / 1e12:.3f} TFLOP a "
          f"step, its softmax {(formula - body) / 1e12:.3f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.adaptive_softmax", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=int, default=1, help="vocabulary and cutoffs this many times smaller")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wikitext2", metavar="DIR", help="also WikiText-2's rows from its data (wiki.*.tokens in DIR)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = scaled(SHAPES["nvidia"], args.scale)
    target = labels(shape)
    counts = torch.bincount(torch.bucketize(target, torch.tensor(shape.cutoffs), right=True)).tolist()
    print(f"NVIDIA's shape{f' / {args.scale}' if args.scale > 1 else ''}: B {shape.batch}, T {shape.tgt_len}, "
          f"M {shape.mem_len}, V {shape.vocab_size:,}, cutoffs {list(shape.cutoffs)}, N {target.numel():,} labels "
          f"(Zipf), per cluster {counts}; 'capacity' rows per tail "
          f"{as_on_cuda(AdaptiveLogSoftmax(model_config(shape)), 'capacity').capacities(target.numel())}")
    soft = {rows: softmax_cost(shape, rows, target, fake=rows == "all") for rows in ROWS}
    tokens = shape.batch * shape.tgt_len
    formula = flops_per_token(shape, "train") * tokens
    body = formula - 6 * softmax_params(shape) * tokens  # the formula's layers and attention
    step = {rows: step_flops(shape, rows) for rows in ("capacity", "all")}
    step["selected"] = step["capacity"] - soft["capacity"][0] + soft["selected"][0]
    print("\n| cluster_rows | softmax TFLOP | formula, its softmax counted | / formula | whole step counted | "
          "/ formula | / 'selected' | softmax peak MB | / 'selected' |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in ROWS:
        flop, peak = soft[rows]
        print(f"| {rows} | {flop / 1e12:.3f} | {(body + flop) / 1e12:.3f} | {(body + flop) / formula:.3f} | "
              f"{step[rows] / 1e12:.3f} | {step[rows] / formula:.3f} | {step[rows] / step['selected']:.3f} | "
              f"{peak / 2**20:,.0f} | {peak / soft['selected'][1]:.3f} |")
    print(f"\nformula (benchmarks.flops, train): {formula / 1e12:.3f} TFLOP a step, its softmax "
          f"{(formula - body) / 1e12:.3f}. The whole step counted also holds what the formula leaves out as MFU does "
          "(the memory rows' keys and values, W_kR R: benchmarks/run.py)")
    if args.wikitext2:
        wikitext2_table(args.wikitext2)


if __name__ == "__main__":
    main()
