"""`txl train`: train from a preset (default: a small byte-level model on this Python's stdlib source).

    txl train                                      # the default job: 2,000 seeded steps, ~4.5 min on one CPU thread
    txl train --preset ptb --data.data_dir ../shared/data/ptb
    txl train --preset enwik8_base --model.mem_len 300 --optim.lr 1e-3
    txl train --config runs/ptb/run.json --train.out_dir runs/ptb2   # a saved run's config
    txl train --resume runs/ptb                    # continue exactly where the run stopped
    torchrun --nproc_per_node 2 -m txl train --preset tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from txl.cli.generate import add_shortcut, add_vocab_argument
from txl.cli.options import add_config_arguments, overrides_from
from txl.config import SECTIONS
from txl.presets import load_preset

if TYPE_CHECKING:
    from txl.config import RunConfig
    from txl.finetune import Init

DEFAULT_PRESET = "default"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model (no arguments: the default job, about 4.5 min on one CPU thread)",
        allow_abbrev=False,
        usage="txl train [--config NAME_OR_FILE | --resume DIR] [--list-presets] [--SECTION.FIELD VALUE ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Transformer-XL. Every config field below can be set as --SECTION.FIELD VALUE; the "
        "rest comes from --config (default: the preset 'default', whose values are shown where they differ "
        "from the field's default).\n"
        "An explicit --train.max_steps (or --max-steps) turns off a preset's time budget unless --train.minutes "
        "is given too.")
    p.add_argument("--config", "--preset", dest="config", default=None, metavar="NAME_OR_FILE",
                   help="a preset name (see --list-presets), a .toml file, or a saved run.json (or its run "
                   "directory); default: 'default'")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue a run from its run directory (latest checkpoint) or a checkpoint directory")
    p.add_argument("--init-from", default=None, metavar="DIR|REPO_ID",
                   help="fine-tune: start from a txl checkpoint / run directory or a Hugging Face transfo-xl "
                   "directory / Hub repo id, keeping its architecture and vocabulary (see txl.finetune)")
    p.add_argument("--revision", default=None, help="--init-from Hub repo revision (default main)")
    add_vocab_argument(p)  # --init-from: the checkpoint's vocabulary, else this file
    add_shortcut(p, "--max-steps", "train.max_steps", type=int)
    add_shortcut(p, "--minutes", "train.minutes", type=float)
    add_shortcut(p, "--out", "train.out_dir")
    p.add_argument("--no-progress", dest="train.progress", action="store_const", const="false",
                   default=argparse.SUPPRESS, help="shortcut for --train.progress false (no bar is drawn anyway "
                   "when stderr is not a terminal)")
    p.add_argument("--overwrite", action="store_true",
                   help="train afresh into a run directory that holds an earlier run, deleting that run")
    p.add_argument("--list-presets", action="store_true",
                   help="one line per preset: what it is, parameters, expected time; then exit")
    add_config_arguments(p, list(SECTIONS), preset=load_preset(DEFAULT_PRESET), preset_name=DEFAULT_PRESET)
    p.set_defaults(func=run)


def list_presets() -> list[str]:
    """One line per preset: name, parameters (counted from the config: no torch imported), what it is."""
    from txl.presets import parameter_count, preset_expected_time, preset_names, preset_summary, run_config

    lines = []
    for name in preset_names():
        n = parameter_count(run_config(name).model)
        size = f"{n / 1e6:.1f}M" if n < 1e9 else f"{n / 1e9:.2f}B"
        lines.append(f"{name:<12} {size:>7} params  {preset_expected_time(name):<38} {preset_summary(name)}")
    return lines


def min_lr_follows_lr(base: dict, overrides: dict) -> None:
    """``--optim.lr`` without ``--optim.min_lr`` scales the config's min_lr with it (their ratio kept), so a
    small fine-tuning rate (the README's 2.5e-5) is not refused for lying below the preset's floor (1e-4)."""
    import logging

    from txl.config import OptimConfig

    if "optim.lr" not in overrides or "optim.min_lr" in overrides:
        return
    optim = {"lr": OptimConfig().lr, "min_lr": OptimConfig().min_lr, **base.get("optim", {})}
    try:
        lr, old_lr, old_min = float(overrides["optim.lr"]), float(optim["lr"]), float(optim["min_lr"])
    except (TypeError, ValueError):
        return  # the config's own check names the bad value
    if old_min and old_lr > 0 and lr != old_lr:
        overrides["optim.min_lr"] = repr(old_min / old_lr * lr)
        logging.getLogger(__name__).info("optim.lr %g without optim.min_lr: min_lr follows it at the config's ratio "
                                         "(%g / %g), %g; give --optim.min_lr to set it", lr, old_min, old_lr,
                                         old_min / old_lr * lr)


def build_config(args: argparse.Namespace, init: Init | None = None):
    """The run's config: --config (or the resumed run's), then the shortcuts, then --SECTION.FIELD;
    ``init``: the checkpoint of --init-from (``txl.finetune.load_init``), whose architecture it keeps."""
    import logging

    from txl.checkpoint import read_run
    from txl.config import RunConfig
    from txl.presets import apply_overrides
    from txl.rundir import find_checkpoint, run_dir_of

    overrides: dict[str, object] = overrides_from(args)  # the shortcuts (--max-steps ...) included
    if args.init_from and args.resume:
        raise ValueError("--init-from starts a new run from a checkpoint's weights, --resume continues a run: "
                         "give one of them")
    if args.resume:
        if args.config:
            raise ValueError("--resume takes the run's config from its checkpoint; drop --config/--preset "
                             "(override single fields with --SECTION.FIELD instead)")
        base = read_run(find_checkpoint(args.resume)).to_dict()
        overrides.setdefault("train.out_dir", str(run_dir_of(args.resume)))
        min_lr_follows_lr(base, overrides)
    else:
        base = load_preset(args.config or DEFAULT_PRESET)
        # The user's step count wins over a preset's time budget (a budget only if asked for with it).
        if "train.max_steps" in overrides and "train.minutes" not in overrides and \
                float(base.get("train", {}).get("minutes", 0) or 0):
            logging.getLogger(__name__).info("train.max_steps given: the preset's %s-minute time budget is off "
                                             "(add --train.minutes to keep one)", base["train"]["minutes"])
            overrides["train.minutes"] = 0
        min_lr_follows_lr(base, overrides)
        if args.init_from:  # fine-tuning: the checkpoint's architecture and vocabulary, the new run's settings
            from txl.finetune import run_config

            return compression_as_asked(run_config(base, overrides, init), overrides)
    return compression_as_asked(RunConfig.from_dict(apply_overrides(base, overrides)), overrides)


def compression_as_asked(cfg: RunConfig, overrides: dict[str, object]) -> RunConfig:
    """``cfg``, unless the command line sets the compressed memory's rate or function without cmem_len, whose 0
    switches it off: the plain model would train and nothing would say so (issue 44). An explicit
    ``--model.cmem_len 0`` beside them is a choice (a sweep's plain baseline) and passes."""
    asked = [key for key in ("model.cmem_rate", "model.cmem_fn") if key in overrides]
    if asked and not cfg.model.cmem_len and "model.cmem_len" not in overrides:
        given = " ".join(f"--{key} {overrides[key]}" for key in asked)
        raise ValueError(f"{given} configures the compressed memory, which model.cmem_len 0 switches off (the "
                         "plain Transformer-XL would train): add --model.cmem_len N, the compressed slots per layer "
                         f"(e.g. --model.cmem_len {cfg.model.mem_len or 64}), or drop {given}")
    return cfg


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        print("\n".join(list_presets()))
        return 0
    init = corpus = None
    if args.init_from:
        from txl.finetune import load_init

        init = load_init(args.init_from, revision=args.revision, vocab=args.vocab)
    elif args.vocab is not None:
        raise ValueError(f"--vocab {args.vocab} is the vocabulary of an --init-from checkpoint; a new run builds its "
                         "own from the corpus (--data.level, --data.vocab_size): add --init-from DIR or drop --vocab")
    cfg = build_config(args, init)
    import logging

    logging.getLogger(__name__).info(getattr(args, "threads_note", ""))
    from txl.cli.options import is_main_process
    from txl.distributed import OtherRankFailed
    from txl.signals import Stopped
    from txl.train import TrainingError, train

    if args.resume and args.overwrite:
        raise ValueError("--resume continues a run and --overwrite deletes it; give one of them")
    if init is not None:
        from txl.finetune import encode_corpus

        corpus = encode_corpus(cfg, init.tokenizer)
    elif "model.vocab_size" in overrides_from(args):  # the corpus sets it: an explicit value must agree
        from txl.data.corpora import load_run_corpus

        corpus = load_run_corpus(cfg.data)
        if corpus.vocab_size != cfg.model.vocab_size:
            raise ValueError(f"--model.vocab_size {cfg.model.vocab_size} disagrees with the corpus {corpus.name!r}, "
                             f"whose vocabulary has {corpus.vocab_size:,} symbols (the model's vocab_size is always "
                             "the corpus's); drop --model.vocab_size")
    from txl.elastic import restart_plan

    resume, overwrite = restart_plan(cfg.train.out_dir, args.resume, args.overwrite)  # torchrun restarts go on
    try:
        result = train(cfg, resume=resume, corpus=corpus, overwrite=overwrite,
                       init=None if init is None else init.model)
    except FileNotFoundError:
        raise  # bad input: the entry point prints it as one line (exit code 2)
    except OtherRankFailed:
        return 1  # the main process says why
    except Stopped as stop:
        if is_main_process():
            print(f"txl train: {stop}", file=sys.stderr)
        return stop.exit_code
    except TrainingError as err:  # the run stopped; the message says what was kept
        if is_main_process():  # every process sees the same loss
            print(f"txl train: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file the run writes (metrics, TensorBoard): the file, and what is intact
        print(f"txl train: error: {err}; {_resume_hint(cfg.train.out_dir)}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        if not _peer_died(err):
            raise
        who = err if type(err).__name__ == "PeerDied" else "another process of this distributed run died"
        print(f"txl train: error: {who} (see its output above); {_resume_hint(cfg.train.out_dir)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # a second Ctrl-C, or a signal after the final checkpoint
        from txl.signals import exit_code, signal_name

        during = getattr(err, "during", "")
        if is_main_process():
            print(f"txl train: interrupted by {signal_name(err)}{f' during {during}' if during else ''}; "
                  f"{_resume_hint(cfg.train.out_dir)}", file=sys.stderr)
        return exit_code(err)
    if not is_main_process():  # another process of a distributed run: rank 0 reports
        return 0
    from txl.runtime import machine_record

    machine = machine_record()  # the figures below reproduce on CPUs of this kind (README, run.json "machine")
    print(f"trained {result.steps} steps (stopped by {result.stopped}); run directory {result.out_dir}; CPU kernels "
          f"{machine['cpu_capability']}, {machine['threads']} thread(s), torch {machine['torch']}, Python "
          f"{machine['python']}")
    print(f"valid (best checkpoint, step {result.best_step}; {result.valid_context}): {result.valid.describe()}")
    if result.test is not None:
        print(f"test (best checkpoint, step {result.best_step}; {result.test_context}; trained with mem_len "
              f"{cfg.model.mem_len}, tgt_len {cfg.train.tgt_len}): {result.test.describe()}")
    if result.sample is not None:
        print("sample (prompt >>> continuation):")
        print(result.sample)
    return 0


def _peer_died(err: RuntimeError) -> bool:
    """Whether a collective failed because another torchrun process is gone (gloo and NCCL's words)."""
    import os

    text = str(err)
    return os.environ.get("WORLD_SIZE", "1") != "1" and (
        type(err).__name__ in ("DistBackendError", "PeerDied") or "closed by peer" in text or "reset by peer" in text)


def _resume_hint(out_dir: str | Path) -> str:
    """The exact resume command when a checkpoint exists (the torchrun command under torchrun), else what to
    do instead."""
    from txl.rundir import latest
    from txl.signals import resume_command

    try:
        found = latest(out_dir)
    except ValueError:
        found = None
    if found is not None and found.is_dir():
        return f"the last checkpoint is {found}; resume with: {resume_command(out_dir)}"
    from txl.rundir import earlier_run

    if not earlier_run(Path(out_dir)):
        return "nothing was written; run the same command again"
    return f"no checkpoint was written, nothing to resume; start again with --out {out_dir} --overwrite"
