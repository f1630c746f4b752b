"""Evaluation speed-up of Transformer-XL over a vanilla Transformer slid over the text (the paper's
Table 9), measured by the benchmark suite (``benchmarks.run``, ``worker_speedup``) rather than by a
second implementation of the same timing.

Transformer-XL reads L-token segments with L cached states (keys and values carried), and the original's
evaluation geometry besides (128-token segments against the same L states); the vanilla model (Al-Rfou et
al. 2018: learned absolute positions, no memory) re-reads an L-token window for every predicted token and
scores its last position. Batch 1, fp32; the three are timed in turn, repetition by repetition, so all see
the same machine.

    python -m experiments.speedup                                    # L = 128 .. 1600, small widths
    python -m experiments.speedup --shape tiny --lengths 8,16 --reps 1   # a smoke test
    python -m experiments.speedup --device cuda --lengths 800,1800,2800,3800   # the paper's lengths, on a GPU
    python -m experiments.speedup --results docs/results             # rewrite the committed table

Each length is warmed up, then timed over --reps repetitions (10) of the three readers in turn; the table
states its regime (model, batch, geometry, precision, repetitions) and each median's spread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import run as bench
from experiments import common
from experiments.paper import TABLE9_SPEEDUP

DEFAULT_RESULTS = common.RUNS_DIR / "speedup"
"""A run writes here unless asked (``--results``): docs/results holds the committed table, changed on purpose."""


def measure(shape: str, lengths: list[int], reps: int, device: str = "cpu") -> dict[str, Any]:
    if shape not in bench.SHAPES:
        raise SystemExit(f"--shape {shape}: not a benchmark shape; choose from {', '.join(bench.SHAPES)}")
    dev = bench.check_device(device)
    rows = bench.worker_speedup(bench.SHAPES[shape], lengths, reps, dev)
    return {"shape": shape, "device": device, "rows": rows,
            "regime": bench.speedup_regime(bench.SHAPES[shape], shape, reps, dev)}


def markdown(rows: list[dict[str, Any]], regime: str = "") -> str:
    table = common.markdown_table(
        ["attention length", "Transformer-XL ms/token", "vanilla ms/token", "speed-up", "FLOP ratio",
         "T = 128: ms/token", "speed-up", "FLOP ratio", "spread (XL, T = 128, vanilla)", "paper (GPU)"],
        [[r["length"], f"{r['xl_ms_per_token']:.3f}", f"{r['vanilla_ms_per_token']:.2f}", f"{r['speedup']:.0f}x",
          f"{r['flop_ratio']:.0f}x", f"{r['xl_short_ms_per_token']:.3f}", f"{r['speedup_short']:.0f}x",
          f"{r['flop_ratio_short']:.0f}x",
          ", ".join(f"{100 * r['spread'][k]:.0f}%" for k in ("xl", "xl_short", "vanilla")),
          f"{r['paper']}x" if r["paper"] else ""]
         for r in rows])
    return f"Regime: {regime}.\n\n{table}" if regime else table


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.speedup", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help="a benchmark shape (benchmarks.run SHAPES)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--lengths", default="128,256,512,800,1600", help="attention lengths (T = M = L)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per length, after the warm-up (default 10)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--results", default=str(DEFAULT_RESULTS),
                   help=f"where speedup.md and .json go (default {DEFAULT_RESULTS.relative_to(common.ROOT)}, "
                        "git-ignored; --results docs/results rewrites the committed table)")
    args = p.parse_args(argv)
    common.setup_logging()
    common.set_threads(args.threads)
    start = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--lengths {args.lengths}: give positive attention lengths")
    payload = {"experiment": "speedup", "command": common.command_line("experiments.speedup", argv),
               **measure(args.shape, lengths, args.reps, args.device), "paper": TABLE9_SPEEDUP}
    payload["wall_s"] = time.perf_counter() - start
    md = markdown(payload["rows"], payload["regime"])
    common.write_results("speedup", payload, md, Path(args.results))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
