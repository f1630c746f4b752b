"""The token cache: encoded corpora as memory-mapped ``.npy`` arrays, written atomically.

An entry is a directory named by a key: the sha256 of the JSON of everything the tokens depend on
(the content digest of every source file and byte range, the tokenizer spec, the corpus options).
A changed file or tokenisation gives a new key, so stale tokens are never reused; an unchanged one
finds its entry and loads at once (the arrays are memory-mapped, not read). Entries are built in a
temporary sibling directory and renamed into place, so a crash never leaves a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from txl.fileio import atomic_write

log = logging.getLogger(__name__)

COMPLETE = "meta.json"  # written last: its presence marks a complete entry


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/txl/tokens`` (``~/.cache/txl/tokens``), read when called, not at import."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "txl" / "tokens"


def cache_key(parts: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def write_tokens(path: Path, chunks: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Stream id chunks into ``path`` (.npy) atomically; return the number of tokens.

    The length is unknown until the last chunk, so chunks go to a raw temporary file first and are
    then copied block by block into the ``.npy`` (memory stays bounded by one chunk).
    """
    info = np.iinfo(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, raw_name = tempfile.mkstemp(dir=path.parent, suffix=".raw")
    raw = Path(raw_name)
    n = 0

    def fill(tmp: Path) -> None:
        nonlocal n
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                if len(chunk) and (chunk.min() < 0 or chunk.max() > info.max):
                    raise ValueError(f"token id out of range for {dtype}: [{chunk.min()}, {chunk.max()}]")
                f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                n += len(chunk)
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
        if n:
            src = np.memmap(raw, dtype=dtype, mode="r", shape=(n,))
            step = 1 << 24
            for i in range(0, n, step):
                out[i:i + step] = src[i:i + step]
            del src
        out.flush()
        del out

    try:
        atomic_write(path, fill)
        return n
    finally:
        raw.unlink(missing_ok=True)


def load_tokens(path: Path) -> np.ndarray:
    """A read-only memory map of a token array (an empty array is returned in memory)."""
    arr = np.load(path, mmap_mode="r")
    return arr


def check_tokens(entry: Path, arrays: dict[str, np.ndarray], vocab_size: int) -> None:
    """Raise ValueError unless each split is a 1-D array of the unsigned dtype ``vocab_size`` needs, with the
    token count the entry's meta.json recorded (an entry edited or forged after it was built)."""
    meta = json.loads((entry / COMPLETE).read_text(encoding="utf-8"))
    for split, arr in arrays.items():
        if arr.ndim != 1 or arr.dtype.kind != "u":
            raise ValueError(f"{split}.npy holds a {arr.dtype} array of shape {arr.shape}, not token ids")
        if len(arr) != meta.get("counts", {}).get(split, len(arr)):
            raise ValueError(f"{split}.npy holds {len(arr):,} tokens, meta.json records {meta['counts'][split]:,}")
        if arr.dtype != dtype_for(vocab_size):  # ids are not scanned: that would read the whole memory map
            raise ValueError(f"{split}.npy holds {arr.dtype} ids, the vocabulary of {vocab_size} needs "
                             f"{dtype_for(vocab_size)}")


def lookup(cache_dir: Path, key: str) -> Path | None:
    """The entry for ``key`` if it is complete, else None."""
    entry = cache_dir / key
    return entry if (entry / COMPLETE).is_file() else None


def build(cache_dir: Path, key: str, fill_files: Callable[[Path], dict[str, Any]]) -> Path:
    """Create the entry for ``key``: ``fill_files(tmpdir)`` writes the files and returns the metadata.

    The metadata is written last, then the directory is renamed into place. If another process
    finished the same entry first, its entry is kept and ours discarded (they are identical).
    """
    entry = cache_dir / key
    meta: dict[str, Any] = {}

    def fill(tmp: Path) -> None:
        meta.update(fill_files(tmp))
        (tmp / COMPLETE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    if not atomic_write(entry, fill, directory=True, replace=False):
        log.debug("cache entry %s was built concurrently; keeping the existing one", key)
    return entry
