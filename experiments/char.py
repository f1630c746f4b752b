"""A small character-level Transformer-XL: bits per character against evaluation attention length.

Trains one model (the paper's relative encoding with segment-level recurrence) on PTB characters
(the original's ``pennchar``) and scores the same validation positions with every attention length of
--contexts, each query attending to exactly that many keys (``common.position_losses``). The paper's
claim: a Transformer-XL evaluated with longer attention than it was trained with keeps getting better.

    python -m experiments.char
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments import common
from txl.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=6000, help="optimiser steps (the budget)")
    p.add_argument("--minutes", type=float, default=0.0, help="also stop after this many minutes (0: no limit)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--mem-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-inner", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--corpus", default="pennchar", help="a registry corpus name (pennchar) or a text file")
    p.add_argument("--data-dir", default=str(common.SHARED_DATA / "ptb-char"))
    p.add_argument("--valid-tokens", type=int, default=0, help="score the first N validation symbols (0: all)")
    p.add_argument("--contexts", default="16,32,64,128,192,256,384,512", help="evaluation attention lengths")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--eval-seg-len", type=int, default=64)
    p.add_argument("--out", default=str(common.RUNS_DIR / "char"))
    p.add_argument("--results", default=str(common.RESULTS_DIR))
    p.add_argument("--threads", type=int, default=0)


def run_config(args: argparse.Namespace, vocab_size: int) -> RunConfig:
    return RunConfig(
        data=DataConfig(corpus=args.corpus, data_dir=args.data_dir),
        model=ModelConfig(vocab_size=vocab_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                          d_inner=args.d_inner, dropout=args.dropout, attn_type="relative", mem_len=args.mem_len),
        optim=OptimConfig(lr=args.lr, min_lr=args.lr / 100, schedule="cosine",
                          warmup_steps=max(1, args.steps // 20), clip=0.25),
        train=TrainConfig(out_dir=args.out, max_steps=args.steps, minutes=args.minutes, batch_size=args.batch_size,
                          tgt_len=args.tgt_len, seed=args.seed, device="cpu", precision="fp32", eval_interval=0,
                          ckpt_interval=max(1, args.steps // 4), keep_last=1, log_interval=max(1, args.steps // 50),
                          tensorboard=False, plot=True, progress=False))


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    common.set_threads(args.threads)
    start = time.perf_counter()
    grid = sorted({int(c) for c in args.contexts.split(",") if c.strip()})
    train_len = args.tgt_len + args.mem_len
    corpus = common.load_trimmed_corpus(args.corpus, args.data_dir, valid_tokens=args.valid_tokens)
    record = common.train_or_skip(run_config(args, corpus.vocab_size), corpus)
    losses = common.cached_position_losses(common.load_trained(args.out), corpus.valid, grid, Path(args.out) / "losses",
                                           n_streams=args.streams, seg_len=args.eval_seg_len, skip=grid[-1] - 1)
    eval_wall = common.eval_seconds(Path(args.out) / "losses", grid)
    bpc = {c: float(np.mean(arr)) / math.log(2) for c, arr in losses.items()}
    best = min(bpc, key=lambda c: (bpc[c], c))
    def note(c: int) -> str:
        return ", ".join(x for x, hit in (("training", c == train_len), ("best", c == best)) if hit)

    rows = [[c, f"{bpc[c]:.3f}", note(c)] for c in grid]  # three decimals: the differences are small
    md = common.markdown_table(["attention length", "bpc", ""], rows)
    payload = {"experiment": "char", "command": common.command_line("experiments.char", argv), "args": vars(args),
               "corpus": corpus.name, "train": {k: v for k, v in record.items() if k != "run"},
               "model": record["run"]["model"], "train_attn_len": train_len, "contexts": grid,
               "bpc": {str(c): v for c, v in bpc.items()}, "best_len": best,
               "bpc_train_len": bpc.get(train_len), "bpc_best": bpc[best],
               "positions": int(next(iter(losses.values())).size), "eval_wall_s": eval_wall,
               "wall_s": time.perf_counter() - start}
    out = Path(args.results)
    common.write_results("char", payload, md, out)
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(grid, [bpc[c] for c in grid], marker="o")
    ax.axvline(train_len, color="k", linestyle=":", label=f"training attention length ({train_len})")
    ax.set_xlabel("evaluation attention length (keys per query)")
    ax.set_ylabel("validation bits per character")
    ax.set_title(f"{corpus.name}: Transformer-XL, relative encoding + recurrence")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "char.png", dpi=120)
    plt.close(fig)
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.char", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    common.setup_logging()
    payload = run(args, argv)
    print(Path(args.results, "char.md").read_text(encoding="utf-8"))
    print(json.dumps({k: payload[k] for k in ("bpc_train_len", "bpc_best", "best_len")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
