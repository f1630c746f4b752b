"""Training speed of candidate model sizes for an ablation budget: seconds per optimiser step, measured.

Each candidate is the ablation's run config (``experiments.ablation.run_config``, relative encoding with
recurrence, the costliest row) with its size flags changed; a few real training steps on the corpus's
own segments are timed after warm-up, and the table gives seconds per step and the core-hours of the
grid at a chosen step budget. The figures depend on what else the machine runs (the JSON keeps the
1-minute load average before and after): say so when quoting them.

    python -m experiments.sizing --corpus wt2 --threads 1       # -> results/sizing_wt2.{json,md}
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from experiments import ablation, common
from txl.data import OrderedIterator
from txl.model import TransformerXL
from txl.optim import build_optimizer
from txl.train import DistInfo, train_step

CANDIDATES = {
    # name: ablation flags (segment and memory as the grid trains them)
    "xs": ["--n-layer", "3", "--d-model", "128", "--n-head", "4", "--d-inner", "512"],
    "s": ["--n-layer", "4", "--d-model", "192", "--n-head", "4", "--d-inner", "768"],
    "m": ["--n-layer", "4", "--d-model", "256", "--n-head", "4", "--d-inner", "1024"],
}


def seconds_per_step(args: argparse.Namespace, corpus, *, steps: int, warmup: int) -> tuple[float, int]:
    cfg = ablation.run_config(ablation.Variant("relative", True), args, corpus.vocab_size)
    torch.manual_seed(0)
    model = TransformerXL(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
    it = iter(OrderedIterator(corpus.train, batch_size=cfg.train.batch_size, tgt_len=cfg.train.tgt_len))
    memories = [None]
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        _, memories = train_step(model, optimizer, scaler, next(it), memories, lr=1e-3, clip=0.25,
                                 precision="fp32", info=info)
    return (time.perf_counter() - start) / steps, sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.sizing", description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", default=",".join(CANDIDATES), help=f"from {', '.join(CANDIDATES)}")
    p.add_argument("--timed-steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--grid-steps", type=int, default=0, help="steps per run for the core-hours column "
                   "(0: the corpus's default --steps)")
    known, rest = p.parse_known_args(argv)
    common.setup_logging()
    rows, records, start, args, load = [], [], time.perf_counter(), None, os.getloadavg()[0]
    for name in known.candidates.split(","):
        if name not in CANDIDATES:
            raise SystemExit(f"--candidates: unknown {name!r}; choose from {', '.join(CANDIDATES)}")
        args = ablation.parse_args([*rest, *CANDIDATES[name]])
        common.set_threads(args.threads)
        corpus = common.load_trimmed_corpus(args.corpus, args.data_dir, valid_tokens=1000)
        s, n_params = seconds_per_step(args, corpus, steps=known.timed_steps, warmup=known.warmup_steps)
        grid_steps = known.grid_steps or args.steps
        runs = len(ablation.variants_of(args))
        rows.append([name, " ".join(CANDIDATES[name]), f"{n_params / 1e6:.2f}M", f"{s:.3f}",
                     f"{args.batch_size * args.tgt_len / s:,.0f}", grid_steps,
                     f"{grid_steps * s / 3600:.2f}", f"{runs * grid_steps * s / 3600:.1f} ({runs} runs)"])
        records.append({"candidate": name, "flags": CANDIDATES[name], "n_params": n_params, "s_per_step": s,
                        "steps_per_run": grid_steps, "runs": runs})
    md = common.markdown_table(["candidate", "flags", "params", "s/step", "tokens/s", "steps/run", "h/run",
                                "grid core-hours"], rows)
    payload = {"experiment": "sizing", "command": common.command_line("experiments.sizing", argv),
               "corpus": args.corpus, "batch_size": args.batch_size, "tgt_len": args.tgt_len, "mem_len": args.mem_len,
               "threads": args.threads, "load_average_1min": [load, os.getloadavg()[0]], "rows": records,
               "wall_s": time.perf_counter() - start}
    common.write_results(ablation.stem("sizing", args.corpus), payload, md, Path(args.results))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
