"""Stop training cleanly on SIGTERM (a scheduler's preemption notice) and Ctrl-C (SIGINT).

The handler only records the request; the training loop looks at it at each step boundary, writes a
checkpoint there and stops, so the run resumes exactly (a checkpoint written from inside a signal
handler could catch the optimiser half-way through a step). A second Ctrl-C raises KeyboardInterrupt
at once, for a user who will not wait for the step to end.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopRequest:
    """Within ``with StopRequest() as stop:``, SIGTERM and SIGINT set ``stop.signal`` instead of
    killing the process; the previous handlers come back on exit. Outside the main thread (where
    Python cannot install handlers) it does nothing and the signals keep their usual effect."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait
        self.signal = signal.Signals(signum)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


class Stopped(Exception):
    """Training stopped at a step boundary on a signal, after writing a checkpoint."""

    def __init__(self, sig: signal.Signals, step: int, checkpoint: object, out_dir: object) -> None:
        self.signal, self.step, self.checkpoint, self.out_dir = sig, step, checkpoint, out_dir
        super().__init__(f"stopped by {sig.name} at step {step}; checkpoint {checkpoint} written. "
                         f"Resume with: txl train --resume {out_dir}")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal)  # the shell's convention for "ended by signal N"
