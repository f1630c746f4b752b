"""The corpus of a run: a named corpus or user text (via txl.data), or 'stdlib', this Python's own
standard-library source, which every machine has: the default job downloads nothing."""

from __future__ import annotations

import hashlib
import logging
import sys
import sysconfig
from pathlib import Path

from txl.config import DataConfig
from txl.data import Corpus, load_corpus
from txl.data.cache import default_cache_dir
from txl.fileio import atomic_write

log = logging.getLogger(__name__)

STDLIB = "stdlib"


def stdlib_text(max_bytes: int, cache_dir: Path) -> Path:
    """Concatenate the standard library's .py files (sorted, UTF-8 only, tests skipped) up to
    ``max_bytes`` into one text file under ``cache_dir``; reused when it exists."""
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{root}|{sys.version}|{max_bytes}".encode()).hexdigest()[:16]
    path = cache_dir / f"stdlib-{key}.txt"
    if path.is_file():
        return path
    parts, total = [], 0
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).parts
        if {"site-packages", "test", "tests", "idle_test"} & set(rel):
            continue
        try:
            data = file.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1000:
        raise FileNotFoundError(f"found no standard-library source under {root}; pass --data.corpus PATH")
    text = b"".join(parts)[:max_bytes]
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(text))
    log.info("standard-library corpus: %s bytes from %s -> %s", f"{len(text):,}", root, path)
    return path


def load_run_corpus(cfg: DataConfig) -> Corpus:
    """Load (encode or read from the cache) the corpus a DataConfig names."""
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    if cfg.corpus == STDLIB:
        path = stdlib_text(cfg.max_bytes, cache_dir.parent / "stdlib")
        return load_corpus(path, level=cfg.level or "byte", cache_dir=cache_dir)
    return load_corpus(cfg.corpus, cfg.data_dir, level=cfg.level, cache_dir=cache_dir)  # type: ignore[arg-type]
