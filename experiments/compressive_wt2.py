"""The compressed memory (Rae et al. 2020) on WikiText-2, beside ``relative-rec`` with the same slots per layer.

Section 7's recall corpus asks whether a compressed memory answers past the plain memory's horizon. This asks
the same of running text with long articles, with the WikiText-2 grid's model, budget and evaluation
(``experiments.ablation --corpus wt2``: 3 layers, d_model 128, segment 64, 4,000 steps, memory 64):

* ``relative-rec``, ``relative-rec-seed1``: the grid's main row and its second seed, memory 64 (trained again
  here, so every row shares this code, this machine and the per-position losses the paired comparisons need);
* ``relative-rec-c32x4``, ``-seed1``: memory 32 and 32 compressed slots at rate 4 ('conv', trained by the
  attention-reconstruction loss): the same 64 slots, so the same keys per query, but one attention hop reaches
  64 + 32 + 4 x 32 = 224 tokens instead of 128.

Compressed and plain are compared seed for seed, position by position; at each length the verdict is 'better'
(or 'worse') only when both seeds' gaps have that sign beyond 2 standard errors and their mean exceeds the gap
between two seeds of the same model; otherwise 'within noise'.

Every row is scored on the same validation positions at every attention length of the grid, the paper's way
(segments of the training length, ``experiments.common.position_losses``). The long-memory sweep grows the
plain memory; a compressed row keeps its 32 slots, so at every length both rows attend to the same number of
keys (the shortest length, 64, leaves no memory beside a compressed row's slots and is not scored for it).

    nohup nice -n 5 python -m experiments.compressive_wt2 --corpus wt2 --data-dir ../shared/data/wikitext-2 \\
        --runs-dir /work/txl-runs/wt2/runs --valid-tokens 60000 --threads 1 > /work/txl-runs/wt2/cmem.log 2>&1 &

The flags are ``experiments.ablation``'s (use the grid's); finished runs and their losses are reused, an
interrupted run resumes. Written: ``results/compressive_wt2.{json,md}``, which ``experiments.report`` sets in
docs/results.md's section 7.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.instruments import cpu_model
from experiments import ablation, common
from experiments.compressive import horizon
from txl.runtime import machine_record

ROWS = ("relative-rec", "relative-rec-seed1", "relative-rec-c32x4", "relative-rec-c32x4-seed1")
"""Two seeds of each model, the plain ones first."""
PAIRS = (("relative-rec-c32x4", "relative-rec"), ("relative-rec-c32x4-seed1", "relative-rec-seed1"))
"""Compressed against plain, seed for seed, position by position."""
SEEDS = (("relative-rec", "relative-rec-seed1"), ("relative-rec-c32x4", "relative-rec-c32x4-seed1"))
"""The same model with two seeds: the run-to-run noise a gap between the models must exceed."""
SIGNIFICANCE = ablation.SIGNIFICANCE


def paired(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Perplexity gap of ``a`` over ``b`` (%; negative: ``a`` is better) and the mean per-position loss
    difference over its paired standard error (the same validation positions)."""
    diff = a - b  # (P,) nats
    se = ablation.standard_error(diff)
    return {"gap_pct": 100 * (math.exp(float(diff.mean())) - 1), "gap_over_se": float(diff.mean()) / se}


def report(runs: dict[str, Any], args: argparse.Namespace, argv: list[str], wall_s: float) -> dict[str, Any]:
    grid = ablation.contexts_of(args)
    rows = {n: ablation.summarise(r["variant"], r["losses"], args) for n, r in runs.items()}
    out_runs = {}
    for name, r in runs.items():
        v, s = r["variant"], rows[name]
        mem = v.mem_len(args)
        out_runs[name] = {
            "mem_len": mem, "cmem_len": v.cmem_len, "cmem_rate": v.cmem_rate if v.cmem_len else 0,
            "cmem_fn": v.cmem_fn if v.cmem_len else None, "seed": args.seed + v.seed,
            "horizon": horizon(n_layer=args.n_layer, mem_len=mem, tgt_len=args.tgt_len, cmem_len=v.cmem_len,
                               cmem_rate=v.cmem_rate),
            "ppl": {str(c): p for c, p in s["ppl"].items()},
            **{k: s[k] for k in ("init_len", "ppl_init", "ppl_best", "best_len", "longest_len", "ppl_longest",
                                 "loss_pct_longest", "positions")},
            "steps": r["record"]["steps"], "train_s": r["record"]["train_s"], "eval_wall_s": r["eval_wall_s"],
            "n_params": r["record"].get("n_params")}
    comparisons = {}
    for comp, plain in PAIRS:
        if comp in runs and plain in runs:
            own, base = runs[comp]["losses"], runs[plain]["losses"]
            comparisons[comp] = {
                "against": plain,
                "by_length": {str(c): paired(own[c], base[c]) for c in grid if c in own and c in base},
                "best_vs_best": paired(own[rows[comp]["best_len"]], base[rows[plain]["best_len"]])}
    noise = [{"pair": [a, b], "by_length": {str(c): paired(runs[a]["losses"][c], runs[b]["losses"][c])
                                            for c in grid if c in runs[a]["losses"] and c in runs[b]["losses"]}}
             for a, b in SEEDS if a in runs and b in runs]
    verdicts = {}
    for c in map(str, grid):
        gaps = [g["by_length"][c] for g in comparisons.values() if c in g["by_length"]]
        spread = [abs(n["by_length"][c]["gap_pct"]) for n in noise if c in n["by_length"]]
        if len(gaps) < len(PAIRS) or len(spread) < len(SEEDS):
            continue  # a verdict needs both seeds of both models
        mean = sum(g["gap_pct"] for g in gaps) / len(gaps)
        agree = all(abs(g["gap_over_se"]) > SIGNIFICANCE and (g["gap_pct"] < 0) == (mean < 0) for g in gaps)
        real = agree and abs(mean) > max(spread)
        verdicts[c] = {"mean_gap_pct": mean, "seed_spread_pct": max(spread),
                       "verdict": ("better" if mean < 0 else "worse") if real else "within noise"}
    payload = {"experiment": "compressive_wt2", "command": common.command_line("experiments.compressive_wt2", argv),
               "corpus": args.corpus, "contexts": grid, "wall_s": wall_s, "args": dict(vars(args)),
               "machine": {**machine_record(), "cpu_model": cpu_model()},
               "runs": out_runs, "comparisons": comparisons, "noise": noise, "verdicts": verdicts,
               "long_memory": ablation.long_memory(runs, rows)}
    md = common.markdown_table(
        ["run", "memory", "compressed (rate)", "one hop", f"{args.n_layer} hops", *[str(c) for c in grid],
         "PPL best (len)", "% at longest", "steps", "train s", "eval s"],
        [[n, o["mem_len"], f"{o['cmem_len']} (x{o['cmem_rate']})" if o["cmem_len"] else "-",
          o["horizon"]["one_hop"], o["horizon"]["n_layer_hops"], *[o["ppl"].get(str(c), "-") for c in grid],
          f"{o['ppl_best']:.2f} ({o['best_len']})", f"{o['loss_pct_longest']:+.1f}", o["steps"],
          f"{o['train_s']:.0f}", f"{o['eval_wall_s']:.0f}"] for n, o in out_runs.items()])
    common.write_results(ablation.stem("compressive", args.corpus), payload, md, Path(args.results))
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.compressive_wt2", description=__doc__.split("\n\n")[0])
    ablation.add_arguments(p)
    p.add_argument("--report-only", action="store_true",
                   help="train and score nothing: write the results of the runs already finished and scored")
    args = ablation.parse_extra_rows(argv, p, "the compressed rows are")
    report_only = args.report_only
    args = args.replace(variants=",".join(ROWS))
    common.setup_logging()
    start = time.perf_counter()
    runs = ablation.collect(args, available_only=report_only)  # train (or resume, or reuse), then score
    payload = report(runs, args, argv, time.perf_counter() - start)
    print(Path(args.results, f"{ablation.stem('compressive', args.corpus)}.md").read_text(encoding="utf-8"))
    return 0 if payload["runs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
