"""Rotary positions (Su et al. 2021) beside the paper's rows: ``rotary-rec`` (Full loss) trained with exactly
the ablation grid's settings (``experiments.ablation``, ``EXTRA_VARIANTS``) and scored with its protocol, at
every attention length of the grid (the longer-memory sweep) and with exactly c keys per query (RECL's).

The grid's own runs are not needed: the row is written to ``results/rotary_<corpus>.{json,md}`` and
``experiments.report`` sets it beside the grid's rows (``ablation_<corpus>.json``) and the paper's.

    nohup nice -n 10 python -m experiments.rotary --corpus wt2 --data-dir ../shared/data/wikitext-2 \\
        --runs-dir /work/txl-runs/wt2/runs --valid-tokens 60000 --threads 1 > /work/txl-runs/wt2/rotary.log 2>&1 &

Same flags as ``experiments.ablation`` (use the grid's: the run is resumable, and a finished run and its
losses are reused).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from experiments import ablation, common

NAME = "rotary-rec"


def report(runs: dict[str, Any], args: argparse.Namespace, argv: list[str], wall_s: float) -> dict[str, Any]:
    r = runs[NAME]
    row = ablation.summarise(r["variant"], r["losses"], args)
    payload = {"experiment": "rotary", "command": common.command_line("experiments.rotary", argv),
               "corpus": args.corpus, "contexts": ablation.contexts_of(args), "wall_s": wall_s,
               "args": dict(vars(args)),
               "run": {"train": {k: v for k, v in r["record"].items() if k != "run"},
                       "model": r["record"]["run"]["model"], "eval_wall_s": r["eval_wall_s"],
                       **{k: v for k, v in row.items() if k != "ppl"},
                       "ppl": {str(c): p for c, p in row["ppl"].items()}},
               "long_memory": ablation.long_memory({NAME: {**r, "variant": ablation.Variant("relative", True)}},
                                                   {NAME: row})[NAME]}
    md = common.markdown_table(
        ["run", "train attn len", "PPL init", "PPL best", "attn len (best)", "gain / SE", "PPL at longest",
         "% vs init", "steps", "train s"],
        [[NAME, row["init_len"], row["ppl_init"], row["ppl_best"], row["best_len"],
          f"{row['gain_nats'] / row['gain_se_nats']:.1f}" if row["gain_se_nats"] > 0 else "-", row["ppl_longest"],
          f"{row['loss_pct_longest']:+.1f}", r["record"]["steps"], f"{r['record']['train_s']:.0f}"]])
    common.write_results(ablation.stem("rotary", args.corpus), payload, md, Path(args.results))
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.rotary", description=__doc__.split("\n\n")[0])
    ablation.add_arguments(p)
    args = ablation.parse_extra_rows(argv, p, "the rotary row is")
    args = args.replace(variants=NAME)
    common.setup_logging()
    start = time.perf_counter()
    runs = ablation.collect(args)  # train (or resume, or reuse), then the table's losses at every length
    payload = report(runs, args, argv, time.perf_counter() - start)
    print(Path(args.results, f"{ablation.stem('rotary', args.corpus)}.md").read_text(encoding="utf-8"))
    return 0 if payload else 1


if __name__ == "__main__":
    raise SystemExit(main())
