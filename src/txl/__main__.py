"""The `txl` command ([project.scripts]) and `python -m txl`: ``txl.cli.main``, imported under the same rule for
signals as the command runs under (``txl.signals``): a Ctrl-C while the command line's modules are still being
imported is one line and exit 130, as at any later moment, never a KeyboardInterrupt traceback. (Before Python
installs its own SIGINT handler, in the first milliseconds of the interpreter, Ctrl-C ends the process silently
by the signal, which a shell also reports as 130.)"""

import sys


def entry() -> int:
    try:  # first: nothing but this module and sys is imported yet
        from txl.signals import terminate_raises

        with terminate_raises():
            from txl.cli import main

            return main()
    except KeyboardInterrupt as err:  # while txl.cli was imported (main reports the later ones itself)
        import os

        from txl.signals import command_of, exit_code, interrupted_line

        if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 prints (as cli.options.is_main_process)
            print(interrupted_line(command_of(sys.argv[1:]), err), file=sys.stderr)
        return exit_code(err)


if __name__ == "__main__":
    sys.exit(entry())
