"""`txl consolidate`: a sharded (--train.parallel fsdp) checkpoint as one plain model directory.

    txl consolidate runs/big -o models/big          # the run's best checkpoint (else its latest)
    txl consolidate runs/big/checkpoints/step_00001000 -o models/big-1000

The weights are read whole from the torch.distributed.checkpoint shards in this one process (no process
group, any number of writers) and written as config.json + model.safetensors, with the run's tokenizer/
and run.json, so every reader of model directories takes it. ``txl.from_pretrained``, ``txl eval``,
``txl export`` and ``txl serve`` also read a sharded checkpoint directly; this writes it once.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("consolidate", help="write a sharded (FSDP) checkpoint as a plain model directory")
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT_DIR",
                   help="a run directory (its best checkpoint, else its latest) or one checkpoint directory")
    p.add_argument("--output", "-o", required=True, metavar="MODEL_DIR", help="the model directory to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from txl.checkpoint import RUN_FILE, TOKENIZER_DIR, find_checkpoint
    from txl.fileio import atomic_write
    from txl.pretrained import from_pretrained, save_pretrained

    source = find_checkpoint(args.checkpoint, "best")
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} already holds files; choose an empty or new --output directory")
    model = from_pretrained(source)

    def write(tmp: Path) -> None:
        save_pretrained(model, tmp)
        for name in (TOKENIZER_DIR, RUN_FILE):
            if (source / name).is_dir():
                shutil.copytree(source / name, tmp / name)
            elif (source / name).is_file():
                shutil.copy2(source / name, tmp / name)

    if out.exists():
        out.rmdir()
    atomic_write(out, write, directory=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {n:,} parameters from {source} (config.json, model.safetensors, tokenizer/)")
    return 0
