"""A markdown table comparing two runs of benchmarks.run (their results.jsonl), phase by phase.

    python -m benchmarks.compare before/results.jsonl after/results.jsonl

Rows pair the phases of the same shape, dtype and kind; a phase the first run lacks (e.g. 'train-keep',
which older versions did not have) gets empty 'before' cells. The speed-up sweeps are set side by side
by attention length.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ("train", "train-keep", "train-recompute", "eval")


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def spread(r: dict, key: str, fmt: str) -> str:
    """The reported value, with the range over repeated runs when there were several."""
    runs, value = r.get(f"{key}_runs"), format(r[key], fmt)
    return value if not runs else f"{value} ({format(min(runs), fmt)}-{format(max(runs), fmt)})"


def phase_table(before: list[dict], after: list[dict]) -> str:
    old = {(r["shape"], r["dtype"], r["kind"]): r for r in before if r["kind"] in PHASES}
    rows = ["| shape | dtype | phase | tok/s before | tok/s after | MFU before | MFU after | peak RSS MB before "
            "| after |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in after if r["kind"] in PHASES):
        b = old.get((r["shape"], r["dtype"], r["kind"]))
        cells = [spread(b, "tokens_per_s", ".0f"), spread(r, "tokens_per_s", ".0f"), spread(b, "mfu", ".2f"),
                 spread(r, "mfu", ".2f"), spread(b, "peak_rss_mb", ".0f"), spread(r, "peak_rss_mb", ".0f")] if b else \
                ["", spread(r, "tokens_per_s", ".0f"), "", spread(r, "mfu", ".2f"), "", spread(r, "peak_rss_mb", ".0f")]
        rows.append(f"| {r['shape']} | {r['dtype']} | {r['kind']} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def speedup_table(before: list[dict], after: list[dict]) -> str:
    old = {row["length"]: row for r in before if r["kind"] == "speedup" for row in r["rows"]}
    rows = ["| L | XL ms/tok before | vanilla ms/tok | speed-up before | XL ms/tok after | vanilla ms/tok | "
            "speed-up after | FLOP ratio (after) | paper (GPU) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in after if r["kind"] == "speedup"):
        for row in r["rows"]:
            b = old.get(row["length"])
            before_cells = (f"{b['xl_ms_per_token']:.3f} | {b['vanilla_ms_per_token']:.1f} | {b['speedup']:.0f}x"
                            if b else " |  | ")
            paper = f"{row['paper']}x" if row.get("paper") else ""
            rows.append(f"| {row['length']} | {before_cells} | {row['xl_ms_per_token']:.3f} | "
                        f"{row['vanilla_ms_per_token']:.1f} | {row['speedup']:.0f}x | {row['flop_ratio']:.0f}x "
                        f"| {paper} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    args = p.parse_args(argv)
    before, after = load(args.before), load(args.after)
    print(phase_table(before, after))
    if any(r["kind"] == "speedup" for r in after):
        print(speedup_table(before, after))


if __name__ == "__main__":
    main()
