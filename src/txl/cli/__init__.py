"""The `txl` command: one entry point, one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` (registering its arguments and setting
``func``) and keeps its heavy imports inside the function it runs: parsing, and so `txl --help` and
`txl train --help`, never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import sys

from txl import __version__
from txl.cli import data, generate, score, serve
from txl.cli import eval as eval_cmd
from txl.cli import export as export_cmd
from txl.cli import train as train_cmd
from txl.cli.options import is_main_process

SUBCOMMANDS = [data, train_cmd, eval_cmd, generate, score, export_cmd, serve]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="txl", description="Transformer-XL language models.", allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"txl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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
    main_process = is_main_process()  # under torchrun only rank 0 prints and logs
    logging.basicConfig(level=(logging.DEBUG if args.verbose else logging.INFO) if main_process else logging.ERROR,
                        format="%(message)s", stream=sys.stderr)
    from txl.runtime import retain_freed_memory

    retain_freed_memory()  # reuse freed tensor pages instead of faulting them in again every step
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
        if main_process:
            print(f"txl {args.command}: error: {err}", file=sys.stderr)
        return 2
