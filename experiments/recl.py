"""Relative effective context length (Dai et al. 2019, Appendix C) of the ablation's models.

The group is every model of ``experiments.ablation`` (on WikiText-2 the paper's Table 8 group,
``GROUPS``; the same flags select and, if needed, train them; finished runs and their losses are
reused). Each model is scored on the same validation positions at every attention length c of
--contexts, each query attending to exactly c keys (``mem_len = c`` with ``same_length``;
``common.position_losses``). Why this choice: RECL compares l_i(c, t) across models and lengths on
identical positions, so every position must really see c keys (hence the dropped warm-up positions and
same_length, which stops the last queries of a segment seeing more keys than the first ones). For
recurrent models the cached states still carry older information through the layers; that is the
mechanism RECL is meant to credit.

RECL is computed with ``txl.recl`` for r = 0.1, 0.5 and 1 (the paper's Table 8/9), threshold 0.01,
starting at the shortest context and stepping along the grid.

    python -m experiments.recl --steps 3000      # same flags as experiments.ablation
    python -m experiments.recl --corpus wt2 --runs-dir /work/txl-runs/wt2       # the WikiText-2 group
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments import ablation, common
from txl.recl import recl_details

RATIOS = (0.1, 0.5, 1.0)
GROUPS = {"wt2": ("relative-rec", "shaw-rec", "relative-norec", "al_rfou-norec-half")}
"""The RECL group per corpus, where it is not every ablation run: RECL measures each model against the best
of its group, so WikiText-2 uses the paper's Table 8 group (Transformer-XL, with Shaw et al.'s encoding,
without recurrence, the vanilla Transformer: Al-Rfou et al. with the Half loss), not the Half, Full-Transformer
and second-seed rows. PTB's group is its eight runs."""


def group_of(runs: dict[str, Any], corpus: str) -> dict[str, Any]:
    """The runs of ``corpus``'s RECL group that are at hand, in the group's order."""
    if corpus not in GROUPS:
        return runs
    return {name: runs[name] for name in GROUPS[corpus] if name in runs}


def compute(runs: dict[str, Any], grid: list[int], threshold: float) -> dict[float, dict[str, Any]]:
    """{r: {model: RECLResult}} over the group of all runs."""
    losses = {name: r["losses"] for name, r in runs.items()}
    return {r: recl_details(losses, grid, r=r, threshold=threshold) for r in RATIOS}


def diagnose(losses: dict[int, np.ndarray], grid: list[int]) -> dict[str, float]:
    """What a model's RECL should be read beside: its perplexity at the shortest and longest context, and
    how much its per-position losses move between neighbouring contexts (mean |l(c', t) - l(c, t)|, nats).
    RECL credits a model wherever its loss at c' falls below the group's best at c, and never debits it
    where it rises (the min in f_i), so losses that move a lot at random also earn gains."""
    moves = [float(np.mean(np.abs(losses[b] - losses[a]))) for a, b in zip(grid, grid[1:], strict=False)]
    return {"ppl_first": math.exp(float(np.mean(losses[grid[0]]))),
            "ppl_last": math.exp(float(np.mean(losses[grid[-1]]))), "volatility": float(np.mean(moves))}


def report(runs: dict[str, Any], args: argparse.Namespace, argv: list[str], wall_s: float) -> dict[str, Any]:
    runs = group_of(runs, args.corpus)
    grid = ablation.contexts_of(args)
    results = compute(runs, grid, args.threshold)
    rows, diagnostics = [], {name: diagnose(runs[name]["losses"], grid) for name in runs}
    for name in runs:
        cells = []
        for r in RATIOS:
            d = results[r][name]
            cells.append(f"{'>=' if d.saturated else ''}{d.recl}")
        dg = diagnostics[name]
        rows.append([name, *cells, f"{dg['ppl_first']:.2f}", f"{dg['ppl_last']:.2f}", f"{dg['volatility']:.3f}"])
    md = common.markdown_table(["model", *[f"RECL r={r:g}" for r in RATIOS], f"PPL at c={grid[0]}",
                                f"PPL at c={grid[-1]}", "mean abs. change (nats)"], rows)
    payload = {
        "experiment": "recl", "command": common.command_line("experiments.recl", argv), "contexts": grid,
        "threshold": args.threshold, "wall_s": wall_s, "group": list(runs),
        "positions": int(next(iter(next(iter(runs.values()))["losses"].values())).size),
        "diagnostics": diagnostics,
        "recl": {str(r): {name: {"recl": d.recl, "saturated": d.saturated, "gains": [list(g) for g in d.gains]}
                          for name, d in results[r].items()} for r in RATIOS},
    }
    out, name = Path(args.results), ablation.stem("recl", args.corpus)
    payload["corpus"] = args.corpus
    common.write_results(name, payload, md, out)
    plot(results, list(runs), out / f"{name}.png")
    return payload


def plot(results: dict[float, dict[str, Any]], names: list[str], png: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(RATIOS), figsize=(4 * len(RATIOS), 3.8), sharey=True)
    for ax, r in zip(axes, RATIOS):
        for i, name in enumerate(names):
            gains = results[r][name].gains
            ax.plot([g[0] for g in gains], [100 * g[2] for g in gains], marker="o", markersize=3,
                    color=f"C{i}", linestyle="-" if name.endswith("-rec") else "--", label=name)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_title(f"r = {r:g}")
        ax.set_xlabel("context c (gain from c to the next length)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative gain g(c, c + step), % (stop below 1%)")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ablation's flags (they select, and if needed train, the group) and RECL's threshold."""
    ablation.add_arguments(p)
    p.add_argument("--threshold", type=float, default=0.01, help="stop at the first relative gain below this")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.recl", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = ablation.parse_args(argv, p)
    common.setup_logging()
    start = time.perf_counter()
    if args.variants == "all" and args.corpus in GROUPS:
        args = args.replace(variants=",".join(GROUPS[args.corpus]))  # train and score only the group
    runs = ablation.collect(args, exact=True)
    report(runs, args, argv, time.perf_counter() - start)
    print(Path(args.results, f"{ablation.stem('recl', args.corpus)}.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
