"""Subprocesses in sessions of their own, so that stopping one stops everything it started.

``benchmarks.run`` runs each measurement this way (its workers start torch.compile's compile workers) and
``benchmarks.gpu_session`` each step (a step may be ``benchmarks.run``, whose workers have sessions of their own
again: hence SIGTERM first, which that driver turns into stopping its worker, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End ``proc``'s session: SIGTERM, up to ``grace`` seconds for it to go, then SIGKILL for whatever is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left in the session
        pass
    proc.wait()


def run(cmd: list[str] | tuple[str, ...], timeout: float | None, **popen) -> tuple[subprocess.Popen, str, str, bool]:
    """Run ``cmd`` in a session of its own for at most ``timeout`` seconds (None: no limit); (process, stdout,
    stderr, timed out). Past the limit, or on any exception here (Ctrl-C, SIGTERM via ``exit_on_sigterm``), the
    session is stopped. stdout and stderr are None unless ``popen`` asks for pipes."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        return proc, *proc.communicate(timeout=timeout), False
    except subprocess.TimeoutExpired:
        stop(proc)
        return proc, *proc.communicate(), True
    except BaseException:
        stop(proc)
        raise


def exit_on_sigterm() -> None:
    """SIGTERM (a time limit from outside) as SystemExit, so ``run``'s session is stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
