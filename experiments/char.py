"""A small character-level Transformer-XL: bits per character against evaluation attention length.

Trains one model (the paper's relative encoding with segment-level recurrence) on PTB characters
(the original's ``pennchar``) and scores the same validation positions with every attention length of
--contexts, each query attending to exactly that many keys (``common.position_losses``). The paper's
claim: a Transformer-XL evaluated with longer attention than it was trained with keeps getting better.

    python -m experiments.char
    python -m experiments.char --model.pre_ln true --optim.weight_decay 0.01   # any model/optim/train field

The short flags are shortcuts for config fields (``--n-layer`` is ``--model.n_layer``).
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

DEFAULTS: dict[str, Any] = {"steps": 6000, "minutes": 0.0, "batch_size": 16, "tgt_len": 64, "mem_len": 64,
                            "lr": 1e-3, "seed": 0, "n_layer": 3, "d_model": 128, "n_head": 4, "d_inner": 512,
                            "dropout": 0.1}
"""The run's budget and shape: the defaults of the short flags left unset."""

SHORTCUTS = {"steps": "train.max_steps", "minutes": "train.minutes", "batch_size": "train.batch_size",
             "tgt_len": "train.tgt_len", "mem_len": "model.mem_len", "lr": "optim.lr", "seed": "train.seed",
             "n_layer": "model.n_layer", "d_model": "model.d_model", "n_head": "model.n_head",
             "d_inner": "model.d_inner", "dropout": "model.dropout"}
"""Each short flag is a shortcut for a config field (``--n-layer`` is ``--model.n_layer``)."""

FIXED = {"train.out_dir": "give --out", "model.vocab_size": "the corpus sets it"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, help=f"optimiser steps (the budget; default {DEFAULTS['steps']})")
    p.add_argument("--minutes", type=float, help="also stop after this many minutes (default 0: no limit)")
    for flag, kind in (("batch-size", int), ("tgt-len", int), ("mem-len", int), ("lr", float), ("seed", int),
                       ("n-layer", int), ("d-model", int), ("n-head", int), ("d-inner", int), ("dropout", float)):
        p.add_argument(f"--{flag}", type=kind, help=f"default {DEFAULTS[flag.replace('-', '_')]}")
    p.add_argument("--corpus", default="pennchar", help="a registry corpus name (pennchar) or a text file")
    p.add_argument("--data-dir", default=str(common.SHARED_DATA / "ptb-char"))
    p.add_argument("--valid-tokens", type=int, default=0, help="score the first N validation symbols (0: all)")
    p.add_argument("--contexts", default="16,32,64,128,192,256,384,512", help="evaluation attention lengths")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--eval-seg-len", type=int, default=64)
    p.add_argument("--out", default=str(common.RUNS_DIR / "char"))
    p.add_argument("--results", default=str(common.RESULTS_DIR))
    p.add_argument("--threads", type=int, default=0)
    common.add_config_overrides(p)


def resolve(args: argparse.Namespace) -> common.Settings:
    """The settings of ``args``: the ``--SECTION.FIELD`` options taken and the short flags left unset at their
    defaults."""
    return common.resolve_settings(args, SHORTCUTS, FIXED, DEFAULTS)


def run_config(args: argparse.Namespace, vocab_size: int) -> RunConfig:
    return common.with_overrides(RunConfig(
        data=DataConfig(corpus=args.corpus, data_dir=args.data_dir),
        model=ModelConfig(vocab_size=vocab_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                          d_inner=args.d_inner, dropout=args.dropout, attn_type="relative", mem_len=args.mem_len),
        optim=OptimConfig(lr=args.lr, min_lr=args.lr / 100, schedule="cosine",
                          warmup_steps=max(1, args.steps // 20), clip=0.25),
        train=TrainConfig(out_dir=args.out, max_steps=args.steps, minutes=args.minutes, batch_size=args.batch_size,
                          tgt_len=args.tgt_len, seed=args.seed, device="cpu", precision="fp32", eval_interval=0,
                          ckpt_interval=max(1, args.steps // 4), keep_last=1, log_interval=max(1, args.steps // 50),
                          tensorboard=False, plot=True, progress=False)), args.config)


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
    args = resolve(common.parse_known(p, argv))
    common.setup_logging()
    payload = run(args, argv)
    print(Path(args.results, "char.md").read_text(encoding="utf-8"))
    print(json.dumps({k: payload[k] for k in ("bpc_train_len", "bpc_best", "best_len")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
