"""The cost per token of a compressed memory (Rae et al. 2020) against plain memory, on this CPU.

    python -m benchmarks.compressive                  # 4 layers, d_model 256, segment 64, batch 4 (~4 min here)
    python -m benchmarks.compressive --tgt-len 128 --rounds 5

Three models of the same weights' shape: ``plain-M`` (memory M = segment), ``plain-2M`` (memory 2M: the same
slots per layer as the compressive one), ``compressive`` (memory M and M compressed slots at rate 4, 'conv'
with its reconstruction loss). Each is timed for a training step (forward, backward of the LM loss plus the
reconstruction loss, clip, optimiser step: ``txl.train.train_step``) and an evaluation segment (no grad), with
both memories full. The models are timed interleaved, round after round (A, B, C, A, B, C, ...), so a load
change on a shared machine touches all of them alike; each time is the median over rounds of the median over
steps, each ratio the median over rounds of that round's ratio. One thread (torch.set_num_threads(1)), timed by
the process's CPU time by default (``--clock cpu``: what the work costs, not a shared machine's waits). Prints a
table, then one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from txl.config import ModelConfig, OptimConfig
from txl.data import Batch
from txl.distributed import DistInfo
from txl.model import TransformerXL
from txl.optim import build_optimizer
from txl.train import train_step


def models(args: argparse.Namespace) -> dict[str, ModelConfig]:
    base = dict(vocab_size=256, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                d_inner=4 * args.d_model, dropout=0.1, cutoffs=[])
    M = args.tgt_len
    return {f"plain-{M}": ModelConfig(**base, mem_len=M),
            f"plain-{2 * M}": ModelConfig(**base, mem_len=2 * M),
            f"compressive-{M}+{M}x{args.rate}": ModelConfig(**base, mem_len=M, cmem_len=M, cmem_rate=args.rate)}


class Bench:
    """One model with its optimiser and memories filled by enough segments that both memories are full."""

    def __init__(self, cfg: ModelConfig, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.model = TransformerXL(cfg)
        self.optimizer = build_optimizer(self.model, OptimConfig(lr=1e-4))
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        B, T = args.batch, args.tgt_len
        self.x = torch.randint(0, 256, (B, T), generator=g)
        self.batch = Batch(input_ids=self.x, labels=torch.randint(0, 256, (B, T), generator=g), context_len=0,
                           start=1)
        fill = 2 + (cfg.cmem_len * cfg.cmem_rate) // T  # segments until both memories are full
        self.memories = [None]
        self.eval_memory = None
        for _ in range(fill):
            self.train()
            with torch.no_grad():
                self.eval_memory = self.model.eval()(self.x, memory=self.eval_memory).memory

    def train(self) -> None:
        self.model.train()
        _, self.memories = train_step(self.model, self.optimizer, self.scaler, self.batch, self.memories, lr=1e-4,
                                      clip=0.25, precision="fp32", info=self.info)

    @torch.no_grad()
    def eval(self) -> None:
        self.model.eval()(self.x, memory=self.eval_memory, return_log_probs=False)  # same memory each time


def median_ms(fn, steps: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(steps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compressive", description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rate", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                   help="cpu: this process's CPU time (one thread: what the work costs, not the waits of a shared "
                   "machine); wall: elapsed time")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    benches = {name: Bench(cfg, args) for name, cfg in models(args).items()}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, dict[str, list[float]]] = {n: {"train": [], "eval": []} for n in benches}
    for _ in range(args.rounds):  # interleaved: every model once per round
        for name, b in benches.items():
            times[name]["train"].append(median_ms(b.train, args.steps, clock))
            times[name]["eval"].append(median_ms(b.eval, args.steps, clock))
    tokens = args.batch * args.tgt_len
    first = next(iter(times))
    print(f"{args.n_layer} layers, d_model {args.d_model}, segment {args.tgt_len}, batch {args.batch}, "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds x {args.steps} steps, {args.clock} clock "
          "(a shared machine)")
    ratios = {n: {k: statistics.median(a / b for a, b in zip(t[k], times[first][k])) for k in ("train", "eval")}
              for n, t in times.items()}  # per round, then the median: a load change within a round cancels
    print(f"| model | train ms/step | train us/token | x {first} | eval ms/segment | eval us/token | x {first} |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, t in times.items():
        tr, ev = statistics.median(t["train"]), statistics.median(t["eval"])
        print(f"| {name} | {tr:.1f} | {1e3 * tr / tokens:.1f} | {ratios[name]['train']:.2f} | {ev:.1f} "
              f"| {1e3 * ev / tokens:.1f} | {ratios[name]['eval']:.2f} |")
        rows.append({"bench": "compressive", "model": name, "train_ms": tr, "eval_ms": ev, "tokens": tokens,
                     "train_rounds_ms": t["train"], "eval_rounds_ms": t["eval"], **vars(args)})
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
