"""Run a corpus's ablation grid (and its RECL group) as background workers that keep the results current.

One worker process trains its share of the grid (``--worker i/n``: runs i, i + n, ... of the grid in its
priority order, ``experiments.ablation.GRIDS``), and after each run scores it for the ablation table
(the paper's protocol) and for RECL (exactly c keys per query), then rewrites the ablation and RECL
results from every run that is finished and scored so far, its own and the other workers'. Everything
is resumable: an interrupted run continues from its last checkpoint, finished runs and computed losses
are reused, so the same commands restart the grid where it stopped. A worker holds a lock file in the run
directory while it trains that run, so workers started with another split skip it instead of training it
twice.

    # two workers on two cores, in the background (the WikiText-2 plan in docs/results.md)
    for i in 0 1; do nohup nice -n 10 python -m experiments.grid --corpus wt2 --runs-dir /work/txl-runs/wt2 \\
        --threads 1 --worker $i/2 > /work/txl-runs/wt2/worker$i.log 2>&1 & done
    python -m experiments.grid --corpus wt2 --runs-dir /work/txl-runs/wt2 --report-only   # results so far
    python -m experiments.report                                                           # docs/results.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments import ablation, common, recl

log = logging.getLogger(__name__)


def parse_worker(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--worker {text}: write it as i/n, e.g. 0/2 and 1/2 for two workers") from None
    if not 0 <= i < n:
        raise SystemExit(f"--worker {text}: i must be 0 .. n - 1")
    return i, n


LOCK_SUFFIX = ".worker.lock"


def lock_path(run_dir: Path) -> Path:
    """The worker's claim on a run: beside the run directory, not in it, since a run directory holds only
    what txl writes (``txl.rundir`` refuses to overwrite anything else)."""
    return run_dir.with_name(run_dir.name + LOCK_SUFFIX)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _held(lock: Path) -> bool:
    """Whether ``lock`` belongs to a live process of this boot (a process id may be reused after a restart)."""
    try:
        owner = json.loads(lock.read_text(encoding="utf-8"))
        if owner["boot"] != _boot_id():
            return False
        os.kill(int(owner["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable, or the process is gone: stale
    return True


@contextlib.contextmanager
def claim(run_dir: Path) -> Iterator[bool]:
    """Hold ``lock_path(run_dir)`` while training that run: True if this process got it, False if another
    live worker holds it (then this one moves on, so overlapping worker sets never train one run twice)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_path(run_dir)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _held(lock):
                yield False
                return
            lock.unlink(missing_ok=True)  # stale: its owner died
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "boot": _boot_id()}, f)
        try:
            yield True
        finally:
            lock.unlink(missing_ok=True)
        return
    yield False


def command(argv: list[str]) -> list[str]:
    """The flags that define the grid (without this process's --worker / --report-only): passed to
    ``python -m experiments.ablation`` they train what is missing and write the same table."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--worker":
            skip = True
        elif not (a.startswith("--worker=") or a == "--report-only"):
            out.append(a)
    return out


def write_reports(args: argparse.Namespace, argv: list[str], start: float) -> dict[str, Any]:
    """The ablation and RECL results of every run finished and scored so far (nothing is trained)."""
    written = {}
    runs = ablation.collect(args, available_only=True)
    if runs:
        written["ablation"] = ablation.report(runs, args, command(argv), time.perf_counter() - start)
    exact = ablation.collect(args, exact=True, available_only=True)
    if len(recl.group_of(exact, args.corpus)) >= 2:  # RECL compares a group
        written["recl"] = recl.report(exact, args, command(argv), time.perf_counter() - start)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.grid", description=__doc__.split("\n\n")[0])
    recl.add_arguments(p)
    p.add_argument("--worker", default="0/1", help="i/n: train the grid's runs i, i + n, ... (priority order)")
    p.add_argument("--report-only", action="store_true", help="train nothing: write the results of finished runs")
    args = ablation.parse_args(argv, p)
    i, n = parse_worker(args.worker)
    common.setup_logging()
    start = time.perf_counter()
    if not args.report_only:
        for v in ablation.variants_of(args)[i::n]:
            one = args.replace(variants=v.name)
            with claim(Path(args.out) / v.name) as mine:
                if not mine:
                    log.info("%s: another worker is on it, skipped", v.name)
                    continue
                ablation.collect(one)  # train (or resume, or reuse), then the table's losses
                ablation.collect(one, exact=True)  # RECL's losses
            write_reports(args, argv, start)
    written = write_reports(args, argv, start)
    if not written:
        print("no run is finished and scored yet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
