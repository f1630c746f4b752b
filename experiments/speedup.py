"""Evaluation speed-up of Transformer-XL over a vanilla Transformer slid over the text (the paper's
Table 9), taken from the benchmark suite rather than measured twice.

HOOK: the measurement belongs to ``benchmarks/`` (branch ``bench``). This driver calls its
``worker_speedup(shape, lengths, reps)`` and ``SHAPES`` from ``benchmarks/run.py`` when they are in
this checkout; until then it writes ``status: "pending"`` and docs/results.md says so. If the
benchmark's API changes when it lands on main, adapt ``measure`` below (one place).

    python -m experiments.speedup --shape small --lengths 64,128,256 --reps 3
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


def load_benchmark(path: Path = BENCHMARK) -> ModuleType | None:
    """The benchmark module, or None while it (or its speed-up function) is not in this checkout."""
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("txl_benchmarks_run", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the module look themselves up there
    spec.loader.exec_module(module)
    if not all(hasattr(module, name) for name in ("worker_speedup", "SHAPES")):
        return None
    return module


def measure(bench: ModuleType | None, shape: str, lengths: list[int], reps: int) -> dict[str, Any]:
    if bench is None:
        return {"status": "pending", "reason": f"{BENCHMARK.relative_to(ROOT)} with worker_speedup and SHAPES is not "
                                               "in this checkout yet (branch bench); rerun after it is merged"}
    rows = bench.worker_speedup(bench.SHAPES[shape], lengths, reps)
    return {"status": "measured", "shape": shape, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.speedup", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help="a benchmark shape (benchmarks/run.py SHAPES)")
    p.add_argument("--lengths", default="64,128,256,512", help="attention lengths (T = M = L)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--results", default=str(common.RESULTS_DIR))
    args = p.parse_args(argv)
    common.setup_logging()
    start = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    payload = {"experiment": "speedup", "command": common.command_line("experiments.speedup", argv),
               **measure(load_benchmark(), args.shape, lengths, args.reps), "paper": TABLE9_SPEEDUP}
    payload["wall_s"] = time.perf_counter() - start
    if payload["status"] == "measured":
        rows = [[r["length"], r["xl_ms_per_token"], r["vanilla_ms_per_token"], r["speedup"]] for r in payload["rows"]]
        md = common.markdown_table(["attention length", "Transformer-XL ms/token", "vanilla ms/token", "speed-up"],
                                   rows)
    else:
        md = f"Pending: {payload['reason']}.\n"
    common.write_results("speedup", payload, md, Path(args.results))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
