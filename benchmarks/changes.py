"""What single speed changes buy, measured one at a time (A/B) at a benchmark shape.

    python -m benchmarks.changes                 # base shape, two threads (~3 min here)
    python -m benchmarks.changes --shape small

Each line times the library with one change turned off against it turned on, on the same machine minutes
apart, with medians over repeated steps:

* adam: one optimiser step over the model's parameters, ``torch.optim.Adam`` against the fused kernel
  ``build_optimizer`` picks;
* pages: a training step (forward, backward, clip, step) in a fresh process without and with
  ``txl.runtime.retain_freed_memory`` (it is process-wide, so each side gets its own process);
* kv-cache: an evaluation segment with memory, projecting the memory rows' keys and values again against
  carrying them in a ``KVCache``;
* realign: the positional scores of one layer, rel-shifted by pad-and-view (``rel_shift``) plus the mask
  through autograd, against ``realign`` (forward and backward);
* with ``--compile``, also torch.compile: a training step of the eager model against ``torch.compile(model)``
  with default settings (compilation in the untimed warm-up steps; several minutes on a small CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import txl
from benchmarks import run as bench
from txl.config import OptimConfig
from txl.model.kernels import realign
from txl.model.positions import attention_mask, rel_shift
from txl.optim import build_optimizer
from txl.runtime import compile_model, retain_freed_memory


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def adam(shape: bench.Shape) -> tuple[float, float]:
    model = bench.build_model(shape).train()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    plain = torch.optim.Adam(model.parameters(), lr=1e-4)
    fused = build_optimizer(model, OptimConfig(lr=1e-4))
    return median_ms(plain.step, 7), median_ms(fused.step, 7)


def train_step_ms(shape: bench.Shape, reuse: bool, compiled: bool = False) -> float:
    """Median training step with or without page reuse (for this whole process) and torch.compile."""
    if reuse:
        retain_freed_memory()
    torch.manual_seed(0)
    model = bench.build_model(shape).train()
    optimizer = build_optimizer(model, OptimConfig(lr=2.5e-4))
    step_model = compile_model(model, compiled)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    memories, times = [None], []
    for i, (x, y) in enumerate(bench.batches(shape, 6, torch.Generator().manual_seed(0))):
        t0 = time.perf_counter()
        memories = bench.library_step(step_model, optimizer, scaler, x, y, memories, "fp32", bench.CPU, i)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def pages(shape_name: str, threads: int) -> tuple[float, float]:
    def spawn(reuse: bool) -> float:
        cmd = [sys.executable, "-m", "benchmarks.changes", "--shape", shape_name, "--threads", str(threads),
               "--worker", "reuse" if reuse else "no-reuse"]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                         cwd=bench.ROOT).stdout)["ms"]
    return spawn(False), spawn(True)


@torch.inference_mode()
def kv_cache(shape: bench.Shape) -> tuple[float, float]:
    torch.manual_seed(0)
    model = bench.build_model(shape).eval()
    (x0, _), (x, _) = bench.batches(shape, 2, torch.Generator().manual_seed(0))
    first = model(x0, kv_cache=txl.KVCache())
    return (median_ms(lambda: model(x, memory=first.memory), 5),
            median_ms(lambda: model(x, memory=first.memory, kv_cache=first.kv_cache), 5))


def realign_ms(shape: bench.Shape) -> tuple[float, float]:
    H, B, T, M = shape.n_head, shape.batch, shape.tgt_len, shape.mem_len
    K = M + T
    scores = torch.randn(H, B, T, K)
    mask = attention_mask(T, M, mem_len=M, same_length=False, style="pytorch")
    mask_bias = torch.zeros(T, K).masked_fill_(mask, float("-inf"))
    grad = torch.randn(B, H, T, K)

    def old():
        s = scores.clone().requires_grad_()
        (rel_shift(s).permute(1, 0, 2, 3) + mask_bias).backward(grad)

    def new():
        s = scores.clone().requires_grad_()
        realign(s, mask_bias, heads_first=True).backward(grad)
    return median_ms(old, 7), median_ms(new, 7)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="base", choices=list(bench.SHAPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time torch.compile (slow to compile)")
    p.add_argument("--worker", choices=["reuse", "no-reuse"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = bench.SHAPES[args.shape]
    if args.worker:
        print(json.dumps({"ms": train_step_ms(shape, args.worker == "reuse")}))
        return
    rows = {"adam (optimiser step)": adam(shape), "pages (training step)": pages(args.shape, args.threads),
            "kv-cache (evaluation segment)": kv_cache(shape), "realign (one layer, fwd+bwd)": realign_ms(shape)}
    if args.compile:
        retain_freed_memory()  # both sides as the txl command runs
        rows["torch.compile (training step)"] = (train_step_ms(shape, True), train_step_ms(shape, True, compiled=True))
    print(f"{args.shape} shape, {args.threads} threads: median ms, change off -> on")
    for name, (off, on) in rows.items():
        print(f"  {name:<32} {off:8.1f} -> {on:8.1f}  ({100 * (on / off - 1):+.0f}%)")
    print(json.dumps({"kind": "changes", "shape": args.shape, "threads": args.threads,
                      "ms": {name: {"off": off, "on": on} for name, (off, on) in rows.items()}}))


if __name__ == "__main__":
    main()
