"""Evaluation speed-up of Transformer-XL over a vanilla Transformer slid over the text (the paper's
Table 9), measured by the benchmark suite (``benchmarks.run``, ``worker_speedup``) rather than by a
second implementation of the same timing.

Transformer-XL reads L-token segments with L cached states (keys and values carried); the vanilla model
(Al-Rfou et al. 2018: learned absolute positions, no memory) re-reads an L-token window for every
predicted token. Batch 1, fp32; the two are timed in turn, repetition by repetition, so both see the
same machine.

    python -m experiments.speedup                                    # L = 128 .. 1600, small widths
    python -m experiments.speedup --shape tiny --lengths 8,16 --reps 1   # a smoke test
    python -m experiments.speedup --device cuda --lengths 800,1800,2800,3800   # the paper's lengths, on a GPU
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


def measure(shape: str, lengths: list[int], reps: int, device: str = "cpu") -> dict[str, Any]:
    if shape not in bench.SHAPES:
        raise SystemExit(f"--shape {shape}: not a benchmark shape; choose from {', '.join(bench.SHAPES)}")
    rows = bench.worker_speedup(bench.SHAPES[shape], lengths, reps, bench.check_device(device))
    return {"shape": shape, "device": device, "rows": rows}


def markdown(rows: list[dict[str, Any]]) -> str:
    return common.markdown_table(
        ["attention length", "Transformer-XL ms/token", "vanilla ms/token", "speed-up", "FLOP ratio", "paper (GPU)"],
        [[r["length"], f"{r['xl_ms_per_token']:.3f}", f"{r['vanilla_ms_per_token']:.2f}", f"{r['speedup']:.0f}x",
          f"{r['flop_ratio']:.0f}x", f"{r['paper']}x" if r["paper"] else ""]
         for r in rows])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.speedup", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help="a benchmark shape (benchmarks.run SHAPES)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--lengths", default="128,256,512,800,1600", help="attention lengths (T = M = L)")
    p.add_argument("--reps", type=int, default=3, help="timed segments / windows per length")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--results", default=str(common.RESULTS_DIR))
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
    md = markdown(payload["rows"])
    common.write_results("speedup", payload, md, Path(args.results))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
