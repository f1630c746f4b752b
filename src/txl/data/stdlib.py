"""The ``stdlib`` corpus: this Python's own standard-library source, which every machine has.

The default job trains on it, so nothing is downloaded. Each ``.py`` file (UTF-8 only; ``test``,
``tests``, ``idle_test`` and ``site-packages`` skipped) goes to train, valid or test by a seeded hash of
its path relative to the standard library, so the three splits are the same kind of text (ordinary
modules from every package) and a file is always in the same split: for the same Python version the
splits are the same on every machine. The files are taken in the order of the same hash (a seeded
shuffle) until each split has its share of ``max_bytes`` (90/5/5 %), the last one cut at a line end.

The three splits are written as ``train.txt``/``valid.txt``/``test.txt`` into a cache entry keyed by the
Python version, the standard library's location, ``max_bytes`` and the seed; the registry entry
``REGISTRY["stdlib"]`` then reads them like any other corpus's files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from txl.data import cache

log = logging.getLogger(__name__)

SPLIT_SHARES = (("train", 90), ("valid", 5), ("test", 5))
"""Percent of ``max_bytes`` in each split; a path's hash modulo 100 picks its split in the same shares."""
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """(path relative to ``root`` in POSIX form, path) of the source files, sorted by relative path."""
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and d != "__pycache__"]  # not walked at all
        for name in names:
            if name.endswith(".py"):
                path = Path(folder, name)
                out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


def path_hash(rel: str, seed: int) -> int:
    """The seeded hash of a relative path (sha256, so the same on every machine and Python)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{rel}".encode()).digest()[:8], "big")


def split_of(rel: str, seed: int) -> str:
    """The split of a relative path: its hash modulo 100 against the cumulative shares (90/5/5)."""
    bucket, edge = path_hash(rel, seed) % 100, 0
    for split, share in SPLIT_SHARES:
        edge += share
        if bucket < edge:
            return split
    raise AssertionError("the shares sum to 100")


def select(files: list[tuple[str, Path]], max_bytes: int, seed: int) -> dict[str, list[tuple[str, bytes]]]:
    """The files (relative path, contents) of each split, in hash order, each split filled to its share of
    ``max_bytes``; the file that crosses a split's budget is cut after its last line that fits, and fills
    the split. Files are read only when reached (most are not, for the default size); non-UTF-8 is skipped."""
    budget = {split: max_bytes * share // 100 for split, share in SPLIT_SHARES}
    chosen: dict[str, list[tuple[str, bytes]]] = {split: [] for split, _ in SPLIT_SHARES}
    for rel, path in sorted(files, key=lambda f: path_hash(f[0], seed)):
        split = split_of(rel, seed)
        if budget[split] <= 0:
            continue
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(data) >= budget[split]:
            data = data[:data.rfind(b"\n", 0, budget[split]) + 1]  # whole lines, so whole UTF-8 characters
            budget[split] = 0
        else:
            budget[split] -= len(data)
        if data:
            chosen[split].append((rel, data))
        if all(b <= 0 for b in budget.values()):
            break
    return chosen


def build_stdlib_corpus(cache_dir: Path, *, max_bytes: int, seed: int = 0, root: Path | None = None) -> Path:
    """Write (or find) the three split files under ``cache_dir``; return the directory holding them."""
    root = stdlib_root() if root is None else root
    key = cache.cache_key({"kind": "stdlib", "version": 2, "python": sys.version, "root": str(root),
                           "max_bytes": max_bytes, "seed": seed})
    entry = cache.lookup(cache_dir, key)
    if entry is not None:
        return entry
    chosen = select(stdlib_files(root), max_bytes, seed)
    if not all(chosen.values()):
        raise FileNotFoundError(f"found too little standard-library source under {root} for three splits; "
                                "pass --data.corpus PATH")

    def fill(tmp: Path) -> dict[str, Any]:
        for split, parts in chosen.items():
            (tmp / f"{split}.txt").write_bytes(b"".join(data for _, data in parts))
        return {"root": str(root), "python": sys.version, "max_bytes": max_bytes, "seed": seed,
                "files": {split: [rel for rel, _ in parts] for split, parts in chosen.items()},
                "bytes": {split: sum(len(d) for _, d in parts) for split, parts in chosen.items()}}

    entry = cache.build(cache_dir, key, fill)
    sizes = ", ".join(f"{split} {sum(len(d) for _, d in parts):,} bytes in {len(parts)} files"
                      for split, parts in chosen.items())
    log.info("standard-library corpus from %s: %s -> %s", root, sizes, entry)
    return entry
