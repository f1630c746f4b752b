"""The `txl` command ([project.scripts]) and `python -m txl`: ``txl.cli.main``, imported under the same rule for
signals as the command runs under (``txl.signals``): a Ctrl-C while the command line's modules are still being
imported is one line and exit 130, as at any later moment, never a traceback. (Before Python installs its own
SIGINT handler, in the first milliseconds of the interpreter and while it reads the environment's .pth files,
Ctrl-C ends the process by the signal, which a shell also reports as 130.)"""

import sys


def entry() -> int:
    try:  # first: nothing but this module and sys is imported yet
        from txl.signals import deferred, terminate_raises

        with terminate_raises():
            # Signals wait for the end of the import (a fraction of a second): Python would turn one raised in a
            # class body into another error, and a half-imported module could be left behind.
            with deferred():
                from txl.cli import main
            return main()
    except BaseException as err:  # while txl.cli was imported (main reports the later ones itself)
        import os

        from txl.signals import command_of, exit_code, interrupted_line, interruption_in

        cut = interruption_in(err)
        if cut is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 prints (as cli.options.is_main_process)
            print(interrupted_line(command_of(sys.argv[1:]), cut), file=sys.stderr)
        return exit_code(cut)


def lm_eval_entry() -> int:
    """The `txl-lm-eval` command ([project.scripts]): lm-eval's command line with the ``txl`` model registered
    (``txl.lmeval.main``; lm-eval 0.4 reads no entry points, so its own ``lm_eval`` cannot find it). Without the
    [lmeval] extra: one line naming it, exit 2."""
    try:
        from txl.lmeval import main
    except ImportError as err:
        print(f"txl-lm-eval: {err}", file=sys.stderr)
        return 2
    main()
    return 0


if __name__ == "__main__":
    sys.exit(entry())
