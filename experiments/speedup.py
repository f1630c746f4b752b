"""Evaluation speed-up of Transformer-XL over a vanilla Transformer slid over the text (the paper's
Table 9), measured by the benchmark suite (``benchmarks/run.py``, ``worker_speedup``) rather than by a
second implementation of the same timing.

Transformer-XL reads L-token segments with L cached states (keys and values carried); the vanilla model
(Al-Rfou et al. 2018: learned absolute positions, no memory) re-reads an L-token window for every
predicted token. Batch 1, fp32; the two are timed in turn, repetition by repetition, so both see the
same machine.

    python -m experiments.speedup                                    # L = 128 .. 1600, small widths
    python -m experiments.speedup --shape tiny --lengths 8,16 --reps 1   # a smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from experiments import ROOT, common
from experiments.paper import TABLE9_SPEEDUP

BENCHMARK = ROOT / "benchmarks" / "run.py"


def load_benchmark(path: Path = BENCHMARK) -> ModuleType:
    """benchmarks/run.py as a module (it is a script, not part of the installed package)."""
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run this from a full checkout of the repository")
    spec = importlib.util.spec_from_file_location("txl_benchmarks_run", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the module look themselves up there
    spec.loader.exec_module(module)
    return module


def measure(bench: ModuleType, shape: str, lengths: list[int], reps: int) -> dict[str, Any]:
    if shape not in bench.SHAPES:
        raise SystemExit(f"--shape {shape}: not a benchmark shape; choose from {', '.join(bench.SHAPES)}")
    return {"shape": shape, "rows": bench.worker_speedup(bench.SHAPES[shape], lengths, reps)}


def markdown(rows: list[dict[str, Any]]) -> str:
    return common.markdown_table(
        ["attention length", "Transformer-XL ms/token", "vanilla ms/token", "speed-up", "FLOP ratio", "paper (GPU)"],
        [[r["length"], f"{r['xl_ms_per_token']:.3f}", f"{r['vanilla_ms_per_token']:.2f}", f"{r['speedup']:.0f}x",
          f"{r['flop_ratio']:.0f}x", f"{r['paper']}x" if r["paper"] else ""]
         for r in rows])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.speedup", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help="a benchmark shape (benchmarks/run.py SHAPES)")
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
               **measure(load_benchmark(), args.shape, lengths, args.reps), "paper": TABLE9_SPEEDUP}
    payload["wall_s"] = time.perf_counter() - start
    md = markdown(payload["rows"])
    common.write_results("speedup", payload, md, Path(args.results))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
