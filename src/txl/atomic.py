"""Durable, atomic file writes: a crash or a power cut leaves either the old file or the new one.

A rename is atomic, but without ``fsync`` the kernel may persist the rename before the data it names,
so after a power cut the new name can point at an empty or partial file. The order that rules this
out (the one SQLite and PostgreSQL use): write the temporary file, ``fsync`` it, rename it over the
target, then ``fsync`` the directory so the rename itself is on disk.

Every file is created with mode ``0o666`` (directories ``0o777``) filtered by the process umask, like
any file ``open()`` creates: ``tempfile.mkstemp`` would make them ``0o600`` whatever the umask says.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory's entries (a rename or a new file in it); a no-op where directories cannot
    be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (and /proc-like mounts) refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root`` and every directory, deepest first (before renaming ``root``)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def create_empty(path: Path) -> None:
    """Create ``path`` new with the umask's mode (``O_EXCL``: never an existing file)."""
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """``write(tmp)`` fills a temporary file beside ``path``; it is fsynced and renamed over ``path``,
    and the directory fsynced. On any error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    create_empty(tmp)  # 0o666 & ~umask, the mode an ordinary open() gives
    mode = tmp.stat().st_mode & 0o777  # the umask's mode, learnt without changing the process umask
    try:
        write(str(tmp))
        if tmp.stat().st_mode & 0o777 != mode:  # a writer that replaced the file (safetensors: 0o600)
            os.chmod(tmp, mode)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
