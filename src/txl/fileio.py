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


class WriteError(OSError):
    """A file a command writes could not be written; the message names the file and the OS's reason."""

    def __init__(self, path: str | os.PathLike, err: BaseException, fix: str = "") -> None:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
        errno = err.errno if isinstance(err, OSError) else None
        super().__init__(errno, f"could not write {path} ({reason}){'; ' + fix if fix else ''}")
        self.path, self.reason = Path(path), reason

    def __str__(self) -> str:
        return str(self.strerror)


def check_output(path: str | os.PathLike, flag: str, example: str = "output") -> Path:
    """The output-path rule every command follows, checked before any work is done: the parent must be an
    existing directory this process may write in, and ``path`` must not be a directory or a read-only file.
    Each case is one ValueError/FileNotFoundError naming ``flag``, the path and the fix. The write itself
    then goes through ``atomic_write`` (a full disk leaves the old file, or none) and reports an OSError
    as a ``WriteError``."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name, e.g. {flag} {out / example}")
    if not out.parent.is_dir():
        what = "is a file, not a directory" if out.parent.exists() else "does not exist"
        raise FileNotFoundError(f"{flag} {path}: the directory {out.parent} {what}; create it first")
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        where = out if out.exists() else out.parent
        raise ValueError(f"{flag} {path}: {where} is not writable (permission denied); choose another path "
                         "or change its permissions")
    return out


def write_output(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """``atomic_write(path, write)``, with any failure of the write (a full disk, an I/O error) raised as a
    ``WriteError`` naming ``path``; the temporary is removed and an earlier ``path`` is left as it was."""
    try:
        atomic_write(path, write)
    except OSError as err:
        raise WriteError(path, err, "nothing was written there") from err
    return Path(path)


# -- JSON Lines: append-safe rows ----------------------------------------------------------------------

def append_jsonl(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append one row to a JSON Lines file so that a failed write leaves no partial row: the file is cut
    back to its previous length when the write or flush fails (a full disk), and a process killed mid-write
    leaves at most one torn last line, which ``read_jsonl`` drops. A failure raises ``WriteError``."""
    line = memoryview((json.dumps(row) + "\n").encode("utf-8"))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            try:
                while line:  # unbuffered: nothing is left in a buffer to be written later, after the cut
                    line = line[os.write(fd, line):]
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
    except OSError as err:
        raise WriteError(path, err) from err


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of a JSON Lines file and a note on its torn last line (None when there is none).

    Only the last line can be torn (a write cut by a kill or a full disk): it is dropped and described. A bad
    line before the last one means the file was damaged otherwise: ValueError naming the file and line.
    """
    lines = Path(path).read_bytes().split(b"\n")
    rows, torn = [], None
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
            if not isinstance(row, dict):
                raise ValueError("not an object")
        except ValueError as err:
            if any(rest.strip() for rest in lines[i + 1:]):
                raise ValueError(f"{path} line {i + 1} is not a JSON object ({err}); the file is damaged: "
                                 f"delete that line (or the file) and run again") from None
            torn = f"{path} ended in a torn row (line {i + 1}, {len(raw)} bytes, cut by a crash or a full disk)"
            break
        rows.append(row)
    return rows, torn


def write_jsonl(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Replace a JSON Lines file with ``rows`` atomically (a crash keeps the old file whole)."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    try:
        write_text(path, text)
    except OSError as err:
        raise WriteError(path, err) from err


def remove_partial(directory: str | os.PathLike) -> None:
    """Remove the temporary directories that a writer killed mid-write (SIGKILL, power loss) left behind."""
    for tmp in Path(directory).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


__all__ = ["WriteError", "append_jsonl", "atomic_write", "check_output", "fsync_dir", "fsync_file", "fsync_tree",
           "read_jsonl", "remove_partial", "write_json", "write_jsonl", "write_output", "write_text"]
