"""Atomic writes: the one helper every file or directory the library writes goes through.

A reader (or a process restarted after a crash or a full disk) sees either the previous version of a
path or the complete new one, never a half-written one: the content is written under a temporary name
in the same directory (so the rename stays on one file system) and renamed into place with
``os.replace``, which POSIX makes atomic. A failure removes the temporary and leaves the old path as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], *, directory: bool = False,
                 replace: bool = True) -> bool:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it to ``path``.

    ``directory=True`` gives ``write`` an empty temporary directory to fill (a checkpoint, a cache entry)
    instead of a file name. ``replace=False`` keeps an existing ``path`` (another process built the same
    content first) and discards ours. Returns whether ``path`` now holds what ``write`` wrote.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-{path.name}-"))
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
    try:
        write(tmp)
        if path.exists():
            if not replace:
                return False
            if directory:  # os.replace cannot overwrite a non-empty directory: the same step written again
                shutil.rmtree(path)
        try:
            os.replace(tmp, path)
        except OSError:
            if replace or not path.exists():
                raise
            return False  # another process renamed the same content into place first
        return True
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 text."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Atomically write ``data`` as indented JSON."""
    write_text(path, json.dumps(data, indent=2) + "\n")


def remove_partial(directory: str | os.PathLike) -> None:
    """Remove the temporary directories that a writer killed mid-write (SIGKILL, power loss) left behind."""
    for tmp in Path(directory).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


__all__ = ["atomic_write", "remove_partial", "write_json", "write_text"]
