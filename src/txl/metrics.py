"""The metrics of a run: ``metrics.jsonl`` rows (+ TensorBoard events), the learning-curve plot, and the
progress bar that log lines are written above.

Only the main process writes; the others hold a disabled log, so the training loop calls the same
methods everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from txl.fileio import WriteError, append_jsonl, read_jsonl, write_jsonl, write_output

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "learning_curve.png"


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when installed) on the main process; nothing elsewhere.

    Rows are ``{"kind": "train" | "valid" | "test", "step": N, ...values}``. A resumed run drops the rows
    after its checkpoint's step (the resumed steps write them again), so the file reads as one run.
    """

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: int | None) -> None:
        self.path, self.enabled, self.tb = out_dir / METRICS_FILE, enabled, None
        self.tb_dir = out_dir / "tb"
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            rows, torn = read_jsonl(self.path)
            if torn:
                log.warning("%s: dropped it", torn)
            # The resumed steps write their rows again, and the final results (valid_full, test) are
            # recomputed when the resumed run ends: keep neither twice.
            write_jsonl(self.path, [r for r in rows if r.get("step", 0) <= resume_step and r.get("kind") in
                                    ("train", "valid")])
        elif resume_step is None:
            write_jsonl(self.path, [])
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.tb_dir))
            except OSError as err:  # its first event, written by its thread, failed (a full disk)
                raise WriteError(self.tb_dir, err) from err
            except ImportError:
                log.info("tensorboard is not installed (pip install 'txl[tb]'): metrics go to %s only", self.path)

    def write(self, kind: str, step: int, **values: Any) -> None:
        """Append a row (a full disk leaves no partial row: ``txl.fileio.append_jsonl``) and its scalars to
        TensorBoard; a failure of either raises ``WriteError`` naming the file."""
        if not self.enabled:
            return
        append_jsonl(self.path, {"kind": kind, "step": step, **values})
        if self.tb is not None:
            try:
                for key, value in values.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self.tb.add_scalar(f"{kind}/{key}", value, step)
            except Exception as err:  # its writer thread's OSError, raised again here
                self._drop_tb()
                raise WriteError(self.tb_dir, err) from err

    def _drop_tb(self) -> None:
        tb, self.tb = self.tb, None
        with contextlib.suppress(Exception):  # it already failed once; its error has been reported
            tb.close()

    def close(self) -> None:
        if self.tb is not None:
            try:
                self.tb.close()
            except Exception as err:
                self.tb = None
                raise WriteError(self.tb_dir, err) from err
            self.tb = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (a torn last row, left by a crash or a full disk, is skipped)."""
    return read_jsonl(path)[0]


def _save_figure(fig: Any, png: str | Path) -> None:
    """Write a figure atomically: a full disk or a kill leaves the previous png (or none), never a 0-byte
    file; an OSError is a ``WriteError`` naming the file."""
    write_output(png, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def learning_curve_points(rows: list[dict], metric: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of the train and valid rows in the run's metric, not the loss in nats: bits per character
    (``bpc``: byte and char corpora) or perplexity (``ppl``: words)."""
    to_metric = (lambda loss: loss / math.log(2)) if metric == "bpc" else math.exp
    return {kind: [(r["step"], to_metric(r["loss"])) for r in rows if r["kind"] == kind] for kind in ("train", "valid")}


def _pyplot(missing: str) -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or None (logging ``missing``, what the run goes without)
    when matplotlib is not installed: plots are an extra."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info(f"matplotlib is not installed (pip install 'txl[cli]'): {missing}")
        return None
    return plt


def plot_learning_curve(metrics_path: Path, png: Path, metric: str) -> bool:
    """Train and valid loss against step; False when matplotlib is not installed."""
    plt = _pyplot("no learning-curve plot")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, pts in learning_curve_points(read_metrics(metrics_path), metric).items():
        if pts:
            ax.plot(*zip(*pts), label=kind, marker="o" if kind == "valid" else None)
    ax.set_xlabel("step")
    if metric == "bpc":
        ax.set_ylabel("bits per character (bpc)")
    else:
        ax.set_ylabel(f"{metric} (log scale)")
        ax.set_yscale("log")
    ax.set_title(f"learning curve ({metric})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        _save_figure(fig, png)
    finally:
        plt.close(fig)
    return True


def plot_memory_sweep(mem_lens: list[int], values: list[float], metric: str, keys: str, png: str | Path) -> bool:
    """The metric against the memory length (``txl eval --sweep-mem``); title and axis say what each query
    sees (``keys``); False when matplotlib is not installed."""
    plt = _pyplot("no sweep plot")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(mem_lens, values, marker="o")
    # Two lines: one line with the keys of a longer segment ran past the figure's 5 inches (issue 44).
    ax.set_xlabel(f"memory length mem_len\n(keys per query: {keys})")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} against memory length")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        _save_figure(fig, png)
    finally:
        plt.close(fig)
    return True


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _NullBar:
    """What the loop talks to when no bar is shown (another process, --train.progress false, no tqdm)."""

    total: int | None = None

    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, values: dict) -> None: ...
    def refresh(self) -> None: ...
    def close(self) -> None: ...


class _BarHandler(logging.Handler):
    """Writes log records with ``tqdm.write``, so they print above the bar instead of onto its line."""

    def __init__(self, tqdm: Any, stream: Any) -> None:
        super().__init__()
        self.tqdm, self.stream = tqdm, stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class ProgressBar:
    """A tqdm bar whose log lines go above it: while it is open, the root logger's stream handlers write
    through ``tqdm.write``; ``close()`` puts them back."""

    def __init__(self, *, total: int, initial: int, enabled: bool, unit: str = "step", desc: str | None = None,
                 leave: bool = True) -> None:
        self.bar: Any = _NullBar()
        self._tqdm: Any = None
        self._swapped: list[tuple[logging.Handler, logging.Handler]] = []
        # Not into a file or pipe: a redirected log would fill with redrawn bars and cursor escapes.
        if not enabled or not _is_terminal(sys.stderr):
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._tqdm = tqdm
        self.bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True, leave=leave)
        root = logging.getLogger()
        for h in list(root.handlers):
            if type(h) is logging.StreamHandler:
                new = _BarHandler(tqdm, h.stream)
                new.setFormatter(h.formatter)
                new.setLevel(h.level)
                root.removeHandler(h)
                root.addHandler(new)
                self._swapped.append((h, new))

    def write(self, text: str, stream: Any) -> None:
        """A line of output above the bar (or just the line when no bar is shown)."""
        if self._tqdm is not None:
            self._tqdm.write(text, file=stream)
        else:
            stream.write(text + "\n")
            stream.flush()

    def set_total(self, total: int) -> None:
        """The bar's total follows a time budget's horizon (so its ETA is the budget's)."""
        if self.bar.total != total:
            self.bar.total = total
            self.bar.refresh()

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def set_postfix(self, values: dict) -> None:
        self.bar.set_postfix(values)

    def close(self) -> None:
        self.bar.close()
        root = logging.getLogger()
        for old, new in self._swapped:
            root.removeHandler(new)
            root.addHandler(old)
        self._swapped = []


@contextlib.contextmanager
def segment_progress(enabled: bool, desc: str) -> Iterator[Callable[[int, int], None] | None]:
    """An ``on_segment(done, total)`` hook for ``txl.evaluate.evaluate`` that draws a bar of evaluated
    segments, removed when the evaluation ends (None when ``enabled`` is false: nothing drawn)."""
    if not enabled:
        yield None
        return
    bar = ProgressBar(total=0, initial=0, enabled=True, unit="segment", desc=desc, leave=False)
    shown = 0

    def on_segment(done: int, total: int) -> None:
        nonlocal shown
        bar.set_total(total)
        bar.update(done - shown)
        shown = done

    try:
        yield on_segment
    finally:
        bar.close()
