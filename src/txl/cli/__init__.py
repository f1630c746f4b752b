"""The `txl` command: one entry point, one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` (registering its arguments and setting
``func``) and keeps its heavy imports inside the function it runs: parsing, and so `txl --help` and
`txl train --help`, never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from txl import __version__
from txl.cli import consolidate, data, generate, score, serve, size
from txl.cli import eval as eval_cmd
from txl.cli import export as export_cmd
from txl.cli import train as train_cmd
from txl.cli.options import is_main_process
from txl.signals import command_of, deferred, exit_code, interrupted_line, interruption_in, terminate_raises

SUBCOMMANDS = [data, train_cmd, eval_cmd, generate, score, export_cmd, serve, consolidate, size]


def shortcut_conflict(argv: list[str], shortcuts: dict[str, str]) -> str | None:
    """A shortcut and the --SECTION.FIELD it stands for both given: argparse would keep the last silently
    (and never type-check the other), so the command refuses it."""
    given = [a.partition("=")[0] for a in argv if a.startswith("--")]
    for flag, field in shortcuts.items():
        if flag in given and f"--{field}" in given:
            return f"{flag} and --{field} both set {field}; give one of them"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="txl", description="Transformer-XL language models.", allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"txl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    for command in sub.choices.values():  # one thread setting for every command
        command.add_argument("--threads", type=_threads, default=None, metavar="N",
                             help="CPU threads (default: OMP_NUM_THREADS, else 1: the same figures on every machine of "
                             "a CPU kind; torch's all-core default slows ~20x when another process holds a core)")
    return parser


def _threads(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--threads {text!r} must be a whole number >= 1")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    A signal at any moment, even while the parser is built or torch is imported, is one line and exit 128 + N
    (130 for Ctrl-C, 143 for SIGTERM): SIGTERM raises as Ctrl-C does (``txl.signals``) from the first line on.
    """
    try:
        with terminate_raises():
            return _main(argv)
    except BaseException as err:  # start-up: parsing, imports (torch), before the command's own handling
        cut = interruption_in(err)
        if cut is None:
            raise
        if is_main_process():
            print(interrupted_line(command_of(sys.argv[1:] if argv is None else argv), cut), file=sys.stderr)
        return exit_code(cut)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    if extra:  # a misspelt --SECTION.FIELD names the valid fields; anything else says what is accepted
        from txl.cli.options import unknown_option_error

        err = unknown_option_error(extra, getattr(args, "config_sections", []), f"txl {args.command}")
        print(f"txl {args.command}: error: {err}", file=sys.stderr)
        return 2
    conflict = shortcut_conflict(sys.argv[1:] if argv is None else argv, getattr(args, "shortcuts", {}))
    if conflict:
        print(f"txl {args.command}: error: {conflict}", file=sys.stderr)
        return 2
    main_process = is_main_process()  # under torchrun only rank 0 prints and logs
    # txl's own progress lines at INFO; other libraries' (an exporter's hundred lines of chatter) only when they warn.
    level = (logging.DEBUG if args.verbose else logging.INFO) if main_process else logging.ERROR
    logging.basicConfig(level=max(level, logging.WARNING), format="%(message)s", stream=sys.stderr)
    logging.getLogger("txl").setLevel(level)
    # A listing (`txl train --list-presets`) answers from the preset files: no torch, no threads (torch's import
    # alone is seconds and 200 MB, issue 44).
    if not getattr(args, "list_presets", False):
        start_torch(args, main_process)
    try:
        with terminate_raises(), _thread_errors_reported_by_caller():  # SIGTERM: as Ctrl-C, below
            return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
        if interruption_in(err) is not None:
            raise  # a signal that Python wrapped: main reports it as the interruption it is
        if main_process:
            print(f"txl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an output file (a full disk, an I/O error): one line naming it
        if interruption_in(err) is not None:
            raise
        if main_process:
            where = f"{err.filename}: " if getattr(err, "filename", None) and str(err.filename) not in str(err) else ""
            print(f"txl {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM, at any moment: an interruption, not an error
        if main_process:
            print(interrupted_line(args.command, err), file=sys.stderr)
        return exit_code(err)




def start_torch(args: argparse.Namespace, main_process: bool) -> None:
    """Import torch and set its threads (``--threads``), noting the choice in ``args.threads_note``."""
    with deferred():  # a Ctrl-C in torch's C start-up would be lost there (see txl.signals.deferred): raised after
        import torch

        from txl.runtime import choose_threads, oversubscribed, retain_freed_memory

    retain_freed_memory()  # reuse freed tensor pages instead of faulting them in again every step
    threads, why = choose_threads(args.threads)

    torch.set_num_threads(threads)
    args.threads_note = f"CPU threads: {threads} ({why}; --threads N sets it)"
    logging.getLogger(__name__).debug(args.threads_note)  # txl train logs it with the run's settings
    if main_process and (advice := oversubscribed(threads)) is not None:
        logging.getLogger(__name__).warning(advice)


@contextlib.contextmanager
def _thread_errors_reported_by_caller():
    """An OSError in a writer thread (TensorBoard's) is raised again by the writer's next call in the main
    thread, which reports it as one line: the thread's own traceback is not printed as well."""
    import threading

    previous = threading.excepthook

    def hook(exc: threading.ExceptHookArgs) -> None:
        if isinstance(exc.exc_value, OSError):
            logging.getLogger(__name__).debug("thread %s: %s", getattr(exc.thread, "name", "?"), exc.exc_value)
            return
        previous(exc)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
