"""One rule for SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption notice), at any moment.

An interruption is reported as an interruption: one line naming what is intact, exit code 128 + N (130
for SIGINT, 143 for SIGTERM), never a traceback and never an error about something else (a full disk).

* Outside training (start-up, ``txl generate``, ``score``, ``eval``, ``export``, ``data``), the command
  line's entry point runs the command under ``terminate_raises()``: SIGTERM raises ``Interrupted`` as
  Ctrl-C raises KeyboardInterrupt (``Interrupted`` is one), so ``finally`` blocks and atomic writes clean up.
  That holds from the entry point's first line (``txl.__main__.entry``, before ``txl.cli`` is imported). Where
  an exception raised inside an import could be lost or changed (torch's C start-up swallows one; Python 3.11
  wraps one raised in a class body in RuntimeError), ``deferred()`` holds the signal to the end of the import,
  and ``interruption_in`` finds one that another exception wraps.
* In the training loop ``StopRequest`` only records the signal; the loop looks at it at each step
  boundary, writes a checkpoint there and stops (``Stopped``), so the run resumes exactly (a checkpoint
  written from inside a signal handler could catch the optimiser half-way through a step). A second
  Ctrl-C raises ``Interrupted`` at once, for a user who will not wait; ``forced`` records it, so a
  checkpoint write it cut is reported as the interruption it is.
* After the final checkpoint nothing is left to save: ``StopRequest.at_once`` makes a signal raise
  ``Interrupted`` at once (the final validation, test and sample stop), naming what is intact.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM interrupted the work; ``during`` says what was cut and what is intact."""

    def __init__(self, sig: signal.Signals = signal.SIGINT, during: str = "", intact: str = "") -> None:
        super().__init__(sig.name)
        self.signal, self.during = sig, during
        self.intact = intact
        """What is intact, where the command knows better than ``INTACT`` (its moment: ``txl generate`` after its
        first text); '' for INTACT's line."""

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal)


def exit_code(err: KeyboardInterrupt) -> int:
    """128 + the signal's number: 130 for a plain KeyboardInterrupt (Ctrl-C), 143 for SIGTERM."""
    return err.exit_code if isinstance(err, Interrupted) else 128 + int(signal.SIGINT)


def signal_name(err: KeyboardInterrupt) -> str:
    return err.signal.name if isinstance(err, Interrupted) else "SIGINT"


INTACT = {
    "train": "nothing was written; run the same command again",
    "eval": "nothing was written (the sweep's table and plot are written when it ends)",
    "generate": "nothing was generated; nothing was written",  # after the first text: GENERATED
    "score": "an -o file is written whole when scoring ends, so nothing was written",
    "export": "the -o file is written whole when the export ends, so nothing was written",
    "data": "a partial download is kept as FILE.part and resumes, and a token-cache entry is written whole or "
            "not at all: run the same command again",
    "serve": "the server had not started serving; nothing was written",
}
"""What a command interrupted before its own handling (start-up, or where it has none) leaves intact: every file
it writes is atomic or resumable."""

GENERATED = "the text above is all that was generated; nothing was written"
"""``txl generate`` interrupted once it has shown text (``Interrupted.intact``); before, INTACT's line."""


def interruption_in(err: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (or ``Interrupted``) that ``err`` is, or that caused it, or None: Python wraps one raised
    in some places in another exception (3.11 turns one raised in a class body's ``__set_name__``, while a module
    defining a dataclass is imported, into a RuntimeError 'Error calling __set_name__'), which is the interruption
    all the same."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), for a message before it is parsed."""
    return next((a for a in argv if not a.startswith("-")), None)


def interrupted_line(command: str | None, err: KeyboardInterrupt) -> str:
    """The one line a command prints when a signal interrupts it: which command, which signal, what is intact."""
    intact = getattr(err, "intact", "") or INTACT.get(command or "")
    return f"txl{f' {command}' if command else ''}: interrupted by {signal_name(err)}{f'; {intact}' if intact else ''}"


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Within the block SIGTERM raises ``Interrupted(SIGTERM)``, as SIGINT raises KeyboardInterrupt; the
    previous handler comes back on exit (no-op outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum))

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM are recorded, not raised; the first is raised as ``Interrupted`` when the
    block ends. For imports of C extensions that swallow an exception raised inside them: torch's C start-up imports
    numpy and carries on without it when that import fails, so a Ctrl-C there was lost (the command went on) and
    numpy left half-imported. No-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        raise Interrupted(signal.Signals(got[0]))


class StopRequest:
    """Within ``with StopRequest() as stop:``, SIGTERM and SIGINT set ``stop.signal`` instead of
    killing the process; the previous handlers come back on exit. Outside the main thread (where
    Python cannot install handlers) it does nothing and the signals keep their usual effect."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.forced = False
        """A second Ctrl-C raised Interrupted at once (whatever it cut short is reported as interrupted)."""
        self._at_once: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._at_once is not None:
            raise Interrupted(signal.Signals(signum), self._at_once)
        if self.signal is not None and signum == signal.SIGINT:
            self.forced = True
            raise Interrupted(signal.SIGINT)  # a second Ctrl-C: the user does not want to wait
        self.signal = signal.Signals(signum)

    def at_once(self, during: str) -> None:
        """From now on a signal raises ``Interrupted(sig, during)`` at once: nothing is left to save.
        A signal already recorded raises it now."""
        self._at_once = during
        if self.signal is not None and self._previous:
            raise Interrupted(self.signal, during)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


def resume_command(out_dir: object) -> str:
    """The command that resumes the run in ``out_dir`` with the process count this one has. A run written by
    W processes continues exactly with W (each process's RNG streams are its own; another count reshards the
    memories, and its dropout masks differ), so under torchrun (its WORLD_SIZE and LOCAL_WORLD_SIZE, read
    when called) the advice is the torchrun command."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world <= 1:
        return f"txl train --resume {out_dir}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    nodes = max(world // max(local, 1), 1)
    launcher = f"torchrun --nproc_per_node {local}"
    if nodes > 1:
        launcher += f" --nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
    return f"{launcher} -m txl train --resume {out_dir}"


class Stopped(Exception):
    """Training stopped at a step boundary on a signal, after writing a checkpoint."""

    def __init__(self, sig: signal.Signals, step: int, checkpoint: object, out_dir: object) -> None:
        self.signal, self.step, self.checkpoint, self.out_dir = sig, step, checkpoint, out_dir
        super().__init__(f"stopped by {sig.name} at step {step}; checkpoint {checkpoint} written. "
                         f"Resume with: {resume_command(out_dir)}")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal)  # the shell's convention for "ended by signal N"
