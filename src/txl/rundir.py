"""A run directory: its pointers (``latest``, ``best``), and one run and one process at a time.

``latest``/``best`` read the pointer files (``latest.json``, ``best.json``) the checkpointer writes;
``find_checkpoint`` and ``run_dir_of`` go between a run directory and its checkpoints. They live here,
below both ``txl.checkpoint`` (which writes checkpoints) and ``txl.pretrained`` (which loads a model from
a run directory), so neither imports the other for them.

``open_run_dir`` is called by the main process before anything is written:

* it takes an exclusive lock (``flock`` on ``train.lock``): a second process training into the same
  directory refuses instead of interleaving metrics and overwriting checkpoints. The kernel drops the
  lock when its process ends however it ends (kill -9 included), so a lock is never stale;
* a fresh run refuses a directory that already holds files: re-running a command must not truncate
  ``metrics.jsonl``, overwrite ``run.json`` and the pointers, or prune the earlier run's checkpoints.
  The user says which they meant: ``--resume`` (continue it) or ``--overwrite`` (delete the earlier
  run's files and start again). A numbered ``version_N`` directory (Lightning's way) was not chosen:
  ``--resume runs/x`` would then have to guess which version, and the run directory printed at the end
  would differ from the ``--out`` the user typed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

LOCK_FILE = "train.lock"
RUN_FILES = ("run.json", "metrics.jsonl", "latest.json", "best.json", "learning_curve.png", "mem_sweep.png",
             "elastic.json")
CKPT_DIR = "checkpoints"
RUN_DIRS = (CKPT_DIR, "tb")


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message says what to do."""


class RunLock:
    """An exclusive lock on a run directory, held until ``release()`` or the process ends."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"{self.path.parent} is in use by another training process (pid {holder}, lock {self.path}); "
                "wait for it to finish or stop it, or train into another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode("ascii"))  # for the refusal message only; flock is the lock
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (deleting it would race a waiter)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def earlier_run(out_dir: Path) -> list[str]:
    """What in ``out_dir`` would a fresh run mix with or destroy (everything but the lock file)."""
    if not out_dir.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir() if p.name != LOCK_FILE)


def open_run_dir(out_dir: str | os.PathLike, *, resume: bool, overwrite: bool) -> RunLock:
    """Lock ``out_dir`` (creating it) and check that this run may write there; return the held lock.

    A fresh run (``resume=False``) refuses a non-empty directory unless ``overwrite``, which deletes
    the files txl writes (listed in RUN_FILES and RUN_DIRS) and refuses when anything else is there.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out).acquire()  # before looking: two processes must not both see an empty directory
    try:
        found = earlier_run(out)
        if resume or not found:
            return lock
        if not overwrite:
            shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            raise RunDirError(f"{out} already holds a run ({shown}); continue it with txl train --resume {out}, "
                              "start again with --overwrite (deletes it), or choose another --out")
        # a killed atomic write's temporary files are the run's own too
        foreign = [name for name in found if name.rstrip("/") not in RUN_FILES + RUN_DIRS
                   and not name.startswith(".tmp-") and not (name.startswith(".") and name.endswith(".tmp"))]
        if foreign:
            raise RunDirError(f"--overwrite deletes only a run's own files, and {out} also holds "
                              f"{', '.join(foreign[:4])}; choose another --out")
        for name in found:
            path = out / name.rstrip("/")
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return lock
    except BaseException:
        lock.release()
        raise


# -- the run directory's pointers -------------------------------------------------------------------

def _pointer(run_dir: Path, which: str) -> Path | None:
    file = run_dir / f"{which}.json"
    if not file.is_file():
        return None
    try:
        return run_dir / json.loads(file.read_text(encoding="utf-8"))["path"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{file} is corrupt; point it at a directory under {run_dir / CKPT_DIR}, or "
                         "delete it") from None


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The run's most recent checkpoint directory (latest.json), or None before the first one."""
    return _pointer(Path(run_dir), "latest")


def best(run_dir: str | os.PathLike) -> Path | None:
    """The run's checkpoint with the lowest validation loss so far (best.json), or None."""
    return _pointer(Path(run_dir), "best")


def run_dir_of(path: str | os.PathLike) -> Path:
    """The run directory of a run or checkpoint directory (a checkpoint outside a run is its own)."""
    p = Path(path)
    return p.parent.parent if (p / "config.json").is_file() and p.parent.name == CKPT_DIR else p


def find_checkpoint(path: str | os.PathLike, which: str = "latest") -> Path:
    """A checkpoint directory from itself or from a run directory (its ``which`` pointer: latest/best)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"{p} does not exist; pass a run directory (with latest.json) or a "
                                "checkpoint directory (with config.json)")
    for name in (which, "latest"):
        found = _pointer(p, name)
        if found is not None:
            if not found.is_dir():
                raise FileNotFoundError(f"{p / (name + '.json')} points at {found}, which is missing")
            return found
    raise FileNotFoundError(f"{p} holds no checkpoint (no latest.json, no config.json)")
