"""Atomic writes: the one helper every file or directory the library writes goes through.

A reader (or a process restarted after a crash or a full disk) sees either the previous version of a
path or the complete new one, never a half-written one: the content is written under a temporary name
in the same directory (so the rename stays on one file system) and renamed into place with
``os.replace``, which POSIX makes atomic. A failure removes the temporary and leaves the old path as it was.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory's entries (a rename or a new file in it); a no-op where directories cannot
    be opened (Windows) or fsynced (some network file systems)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root`` and every directory, deepest first (before renaming ``root``)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], *, directory: bool = False,
                 replace: bool = True) -> bool:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it to ``path``.

    ``directory=True`` gives ``write`` an empty temporary directory to fill (a checkpoint, a cache entry)
    instead of a file name. ``replace=False`` keeps an existing ``path`` (another process built the same
    content first) and discards ours. Returns whether ``path`` now holds what ``write`` wrote.

    Durability: the new content is fsynced before the rename that publishes it and the directory after
    it, so a power cut cannot leave the new name pointing at missing data. Every file and directory gets
    the mode an ordinary ``open()``/``mkdir()`` gives under the umask (``mkstemp`` would make it private).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"  # remove_partial's pattern
    if directory:
        os.mkdir(tmp, 0o777)
    else:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    mode = tmp.stat().st_mode & 0o777  # the umask's mode, learnt without changing the process umask
    old = None
    try:
        write(tmp)
        if directory:
            fsync_tree(tmp)
        else:
            if tmp.stat().st_mode & 0o777 != mode:  # a writer that replaced the file (safetensors: 0o600)
                os.chmod(tmp, mode)
            fsync_file(tmp)
        if path.exists():
            if not replace:
                return False
            if directory:  # os.replace cannot overwrite a non-empty directory: the same step written again
                old = path.parent / f".tmp-old-{path.name}-{os.getpid()}"
                os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            if replace or not path.exists():
                raise
            return False  # another process renamed the same content into place first
        fsync_dir(path.parent)
        return True
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 text."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Atomically write ``data`` as indented, strict JSON (a NaN or infinity raises ValueError)."""
    write_text(path, json.dumps(data, indent=2, allow_nan=False) + "\n")  # NaN is not JSON: raise instead


def remove_partial(directory: str | os.PathLike) -> None:
    """Remove the temporary directories that a writer killed mid-write (SIGKILL, power loss) left behind."""
    for tmp in Path(directory).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


__all__ = ["atomic_write", "fsync_dir", "fsync_file", "fsync_tree", "remove_partial", "write_json", "write_text"]
