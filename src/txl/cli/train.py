"""`txl train`: train from a preset (default: a small byte-level model on this Python's stdlib source).

    txl train                                      # the default job, about 5 minutes on 2 CPU cores
    txl train --preset ptb --data.data_dir ../shared/data/ptb
    txl train --preset enwik8_base --model.mem_len 300 --optim.lr 1e-3
    txl train --resume runs/ptb                    # continue exactly where the run stopped
    torchrun --nproc_per_node 2 -m txl train --preset tiny
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model (no arguments: the default 5-minute CPU job)",
        description="Train a Transformer-XL. Any config field can be set as --SECTION.FIELD VALUE, with "
        "SECTION one of data, model, optim, train, eval (e.g. --model.mem_len 300 --optim.lr 1e-3).")
    p.add_argument("--preset", default=None,
                   help="preset name (see --list-presets) or a .toml file (default: 'default')")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue a run from its run directory (latest checkpoint) or a checkpoint directory")
    p.add_argument("--max-steps", type=int, default=None, help="shortcut for --train.max_steps")
    p.add_argument("--minutes", type=float, default=None, help="shortcut for --train.minutes (0: no limit)")
    p.add_argument("--out", default=None, help="shortcut for --train.out_dir")
    p.add_argument("--overwrite", action="store_true",
                   help="train afresh into a run directory that holds an earlier run, deleting that run")
    p.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    p.set_defaults(func=run, extra_args=True)


def parse_overrides(extra: list[str]) -> dict[str, str]:
    """['--model.mem_len', '300', '--optim.lr=1e-3'] -> {'model.mem_len': '300', 'optim.lr': '1e-3'}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg:
            raise ValueError(f"unrecognised argument {arg!r}; config fields are set as --SECTION.FIELD VALUE "
                             "(e.g. --model.mem_len 300); see txl train --help")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ValueError(f"--{key} needs a value")
            value, i = extra[i + 1], i + 1
        out[key] = value
        i += 1
    return out


def run(args: argparse.Namespace) -> int:
    from txl.checkpoint import find_checkpoint, read_run
    from txl.cli import is_main_process
    from txl.config import RunConfig, apply_overrides, load_preset, preset_names
    from txl.distributed import OtherRankFailed
    from txl.signals import Stopped
    from txl.train import TrainingError, train

    if args.list_presets:
        print("\n".join(preset_names()))
        return 0
    overrides = parse_overrides(getattr(args, "extra", []))
    for flag, key in ((args.max_steps, "train.max_steps"), (args.minutes, "train.minutes"),
                      (args.out, "train.out_dir")):
        if flag is not None:
            overrides[key] = flag
    if args.resume:
        if args.preset:
            raise ValueError("--resume takes the run's config from its checkpoint; drop --preset "
                             "(override single fields with --SECTION.FIELD instead)")
        base = read_run(find_checkpoint(args.resume)).to_dict()
        overrides.setdefault("train.out_dir", str(_run_dir(args.resume)))
    else:
        base = load_preset(args.preset or "default")
    cfg = RunConfig.from_dict(apply_overrides(base, overrides))
    if args.resume and args.overwrite:
        raise ValueError("--resume continues a run and --overwrite deletes it; give one of them")
    try:
        result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except FileNotFoundError:
        raise  # bad input: the entry point prints it as one line (exit code 2)
    except OtherRankFailed:
        return 1  # the main process says why
    except Stopped as stop:
        if is_main_process():
            print(f"txl train: {stop}", file=sys.stderr)
        return stop.exit_code
    except (TrainingError, OSError) as err:  # the run stopped; the message says what was kept
        if is_main_process() or not isinstance(err, TrainingError):  # every process sees the same loss
            print(f"txl train: error: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        if not _peer_died(err):
            raise
        print(f"txl train: error: another process of this distributed run died (see its output above); "
              f"{_resume_hint(cfg.train.out_dir)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of this step
        print(f"txl train: interrupted; {_resume_hint(cfg.train.out_dir)}", file=sys.stderr)
        return 130
    if not is_main_process():  # another process of a distributed run: rank 0 reports
        return 0
    print(f"trained {result.steps} steps (stopped by {result.stopped}); run directory {result.out_dir}")
    print(f"valid: {result.valid.describe()}")
    if result.test is not None:
        mem = cfg.eval.mem_len if cfg.eval.mem_len is not None else cfg.model.mem_len
        print(f"test (mem_len {mem}, trained with {cfg.model.mem_len}): {result.test.describe()}")
    if result.sample is not None:
        print("sample (prompt >>> continuation):")
        print(result.sample)
    return 0


def _peer_died(err: RuntimeError) -> bool:
    """Whether a collective failed because another torchrun process is gone (gloo and NCCL's words)."""
    import os

    text = str(err)
    return os.environ.get("WORLD_SIZE", "1") != "1" and (
        type(err).__name__ == "DistBackendError" or "closed by peer" in text or "reset by peer" in text)


def _resume_hint(out_dir: str) -> str:
    """The exact resume command when a checkpoint exists, else what to do instead."""
    from pathlib import Path

    from txl.checkpoint import _pointer

    try:
        latest = _pointer(Path(out_dir), "latest")
    except ValueError:
        latest = None
    if latest is not None and latest.is_dir():
        return f"the last checkpoint is {latest}; resume with: txl train --resume {out_dir}"
    return f"no checkpoint was written, nothing to resume; start again with --out {out_dir} --overwrite"


def _run_dir(path: str):
    from pathlib import Path

    p = Path(path)
    return p.parent.parent if (p / "config.json").is_file() and p.parent.name == "checkpoints" else p
