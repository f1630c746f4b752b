"""`txl size`: per-process memory of a training run before it is launched (txl.sizing).

    txl size                                             # the paper's large presets, 1 to 64 processes
    txl size --preset wt103_large --world-size 8,16 --gpu-memory 80
    txl size --preset tiny --world-size 2 --bytes         # exact byte counts

For each preset, process count, DDP and FSDP, without and with activation checkpointing: the bytes of
parameters, gradients, optimiser state, DDP buckets or FSDP's unsharded units in flight, recurrent memory,
activations, and the predicted peak (fp32 weights, Adam), and whether it fits in --gpu-memory GiB.
"""

from __future__ import annotations

import argparse

LARGE = "enwik8_large,text8_large,wt103_large"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("size", help="per-process memory of a training run (DDP and FSDP, any process count)")
    p.add_argument("--preset", "--config", dest="preset", default=LARGE, metavar="NAMES",
                   help=f"comma-separated presets or .toml files (default: {LARGE})")
    p.add_argument("--world-size", default="1,2,4,8,16,64", metavar="N,...", help="process counts")
    p.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                   help="memory of one device in GiB: each row says whether its peak fits (default 80)")
    p.add_argument("--bytes", action="store_true", help="print exact byte counts instead of KiB/MiB/GiB")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from txl.presets import run_config
    from txl.sizing import estimate, human

    try:
        worlds = [int(w) for w in args.world_size.split(",")]
    except ValueError:
        raise ValueError(f"--world-size {args.world_size!r} must be comma-separated integers, e.g. 1,2,8") from None
    if any(w < 1 for w in worlds):
        raise ValueError(f"--world-size {args.world_size!r}: every process count must be at least 1")
    torch.set_num_threads(1)  # the activation count runs one small forward per preset
    fmt = str if args.bytes else human
    limit = args.gpu_memory * 2**30
    cols = ["parallel", "procs", "act ckpt", "params", "grads", "optim", "buckets/unsharded", "memory",
            "activations", "peak", f"fits {args.gpu_memory:g} GiB"]
    for name in args.preset.split(","):
        cfg = run_config(name.strip())
        t, m = cfg.train, cfg.model
        print(f"\n{name}: {m.n_layer} layers, d_model {m.d_model}, global batch {t.batch_size} x tgt_len {t.tgt_len}, "
              f"mem_len {m.mem_len}, grad_accum {t.grad_accum}; fp32 weights, Adam")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for w in worlds:
            if t.batch_size % (w * t.grad_accum):
                print(f"| {w} processes: the batch of {t.batch_size} streams does not split over them |")
                continue
            for parallel in ("ddp", "fsdp"):
                for ckpt in (False, True):
                    s = estimate(cfg, world_size=w, parallel=parallel, checkpointing=ckpt)
                    print("| " + " | ".join([parallel, str(w), "on" if ckpt else "off", fmt(s.params), fmt(s.grads),
                                             fmt(s.optimizer), fmt(s.buckets + s.unsharded), fmt(s.memory),
                                             fmt(s.activations), fmt(s.peak),
                                             "yes" if s.peak <= limit else "no"]) + " |")
    return 0
