"""torch.compile (inductor) against eager on this machine, interleaved in one process, training and evaluation.

    python -m benchmarks.compile --shapes small,word,base --threads 2

For each shape: one model; its ``torch.compile`` wrapper (inductor, the default backend) shares the weights.
Each phase first compiles (the time of the first compiled step is reported as the compile time), then runs
eager and compiled steps alternately, so both see the same machine load; the median step times and their ratio
are reported, with the graph count and breaks of ``torch._dynamo.explain``. Training: forward with labels
and memory, backward, no optimiser (the comparison is the model's); evaluation: ``torch.no_grad()`` forward
with the key/value cache carried, as ``txl.evaluate`` reads a split. fp32, dropout as the shape says.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import txl
from benchmarks.flops import SHAPES, Shape
from benchmarks.instruments import cpu_model
from txl.runtime import retain_freed_memory


def model_of(shape: Shape) -> txl.TransformerXL:
    return txl.TransformerXL(txl.ModelConfig(
        vocab_size=shape.vocab_size, n_layer=shape.n_layer, d_model=shape.d_model, n_head=shape.n_head,
        d_head=shape.d_head, d_inner=shape.d_inner, mem_len=shape.mem_len, dropout=shape.dropout,
        cutoffs=list(shape.cutoffs), div_val=shape.div_val))


def tokens_of(shape: Shape, n: int, seed: int = 0) -> torch.Tensor:
    """(B, n) ids, Zipf-distributed for word-level shapes (every adaptive-softmax cluster is met)."""
    g = torch.Generator().manual_seed(seed)
    if shape.zipf:
        probs = 1.0 / torch.arange(1, shape.vocab_size + 1, dtype=torch.float64)
        return torch.multinomial(probs, shape.batch * n, replacement=True, generator=g).view(shape.batch, n)
    return torch.randint(0, shape.vocab_size, (shape.batch, n), generator=g)


def measure(shape: Shape, phase: str, *, warmup: int, steps: int) -> dict:
    model = model_of(shape)
    compiled = torch.compile(model)
    data = tokens_of(shape, shape.tgt_len * 2 + 1)
    x, y = data[:, :shape.tgt_len], data[:, 1:shape.tgt_len + 1]
    model.eval()
    with torch.no_grad():
        first = model(x, labels=y)  # a full memory, and a cache filled from it: every timed step has one shape
    x, y = data[:, shape.tgt_len:-1], data[:, shape.tgt_len + 1:]
    train = phase == "train"
    model.train(train)

    def step(run) -> float:
        t0 = time.perf_counter()
        if train:
            model.zero_grad(set_to_none=True)
            run(x, labels=y, memory=first.memory).loss.backward()
        else:
            with torch.no_grad():
                run(x, labels=y, memory=first.memory, kv_cache=txl.KVCache())
        return time.perf_counter() - t0

    with torch.set_grad_enabled(train):
        kwargs = dict(labels=y, memory=first.memory) if train else dict(labels=y, memory=first.memory,
                                                                       kv_cache=txl.KVCache())
        explanation = torch._dynamo.explain(model)(x, **kwargs)
    compile_s = step(compiled)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for i in range(warmup + steps):
        for name, run in (("eager", model), ("compiled", compiled))[:: 1 if i % 2 == 0 else -1]:
            t = step(run)
            if i >= warmup:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(phase=phase, graphs=explanation.graph_count, graph_breaks=explanation.graph_break_count,
                compile_s=compile_s, eager_step_s=med["eager"], compiled_step_s=med["compiled"],
                compiled_over_eager=med["eager"] / med["compiled"], steps=steps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="small,word,base")
    p.add_argument("--phases", default="train,eval")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {args.threads} threads", flush=True)
    rows = []
    for name in args.shapes.split(","):
        for phase in args.phases.split(","):
            load = os.getloadavg()[0]
            r = dict(shape=name, **measure(SHAPES[name], phase, warmup=args.warmup, steps=args.steps),
                     load_before=load, load_after=os.getloadavg()[0])
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'shape':<6} {'phase':<6} {'graphs':>6} {'breaks':>6} {'compile s':>9} {'eager s':>8} {'compiled s':>10} "
          f"{'speed-up':>8}")
    for r in rows:
        print(f"{r['shape']:<6} {r['phase']:<6} {r['graphs']:>6} {r['graph_breaks']:>6} {r['compile_s']:>9.1f} "
              f"{r['eager_step_s']:>8.3f} {r['compiled_step_s']:>10.3f} {r['compiled_over_eager']:>7.2f}x")


if __name__ == "__main__":
    main()
