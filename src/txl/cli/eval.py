"""`txl eval`: evaluate a checkpoint in any attention context; sweep the memory length.

    txl eval runs/default                          # best checkpoint, test split, the run's eval context
    txl eval runs/ptb --mem-len 512 --clamp-len 400 --same-length --tgt-len 64
    txl eval runs/default --sweep-mem 0,32,64,128,256 --plot sweep.png
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (loss, ppl or bpc, tokens/s)")
    p.add_argument("checkpoint", help="run directory (uses best.json, else latest.json) or checkpoint directory")
    p.add_argument("--which", choices=["best", "latest"], default="best", help="which checkpoint of a run")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--corpus", default=None, help="corpus name or path (default: the run's)")
    p.add_argument("--data-dir", default=None, help="folder of a named corpus (default: the run's)")
    p.add_argument("--batch-size", type=int, default=None, help="parallel streams (default: the run's eval)")
    p.add_argument("--tgt-len", type=int, default=None, help="segment length")
    p.add_argument("--mem-len", type=int, default=None, help="memory length (longer than training is fine)")
    p.add_argument("--clamp-len", type=int, default=None, help="clamp relative distances (<= 0: none)")
    p.add_argument("--same-length", action=argparse.BooleanOptionalAction, default=None,
                   help="every query attends to the same number of keys")
    p.add_argument("--ext-len", type=int, default=None, help="extended context")
    p.add_argument("--max-batches", type=int, default=0, help="stop after this many segments (0: all)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="fp32",
                   help="fp32 (default, exact); auto: bf16 on a GPU that supports it, else fp32")
    p.add_argument("--compile", action="store_true", help="run the forward through torch.compile")
    p.add_argument("--device", default="auto")
    p.add_argument("--sweep-mem", default=None, metavar="M1,M2,...",
                   help="evaluate once per memory length and print a table")
    p.add_argument("--plot", default=None, help="sweep plot path (default: CHECKPOINT/mem_sweep.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from txl.checkpoint import check_tokenizer, find_checkpoint, load_checkpoint
    from txl.data.corpora import load_run_corpus
    from txl.distributed import resolve_device
    from txl.evaluate import evaluate, plot_sweep
    from txl.runtime import resolve_precision

    _check_args(args)
    device = resolve_device(args.device)
    loaded = load_checkpoint(args.checkpoint, which=args.which, with_state=False, device=device)
    run_cfg, model = loaded.run, loaded.model
    data = run_cfg.data
    if args.corpus or args.data_dir:
        from dataclasses import replace
        data = replace(data, corpus=args.corpus or data.corpus, data_dir=args.data_dir or data.data_dir)
    corpus = load_run_corpus(data)
    check_tokenizer(find_checkpoint(args.checkpoint, args.which), corpus.tokenizer)
    e = run_cfg.eval
    kwargs = dict(metric=corpus.metric, batch_size=args.batch_size if args.batch_size is not None else e.batch_size,
                  tgt_len=args.tgt_len if args.tgt_len is not None else e.tgt_len or run_cfg.train.tgt_len,
                  clamp_len=args.clamp_len if args.clamp_len is not None else e.clamp_len,
                  same_length=args.same_length if args.same_length is not None else e.same_length,
                  ext_len=args.ext_len if args.ext_len is not None else e.ext_len,
                  max_batches=args.max_batches, precision=resolve_precision(args.precision, device),
                  compile=args.compile)
    tokens = corpus.split(args.split)
    print(f"{loaded.path} on {corpus.name} {args.split} (trained with tgt_len {run_cfg.train.tgt_len}, "
          f"mem_len {run_cfg.model.mem_len})")
    if args.sweep_mem:
        try:
            mems = [int(m) for m in args.sweep_mem.split(",") if m.strip()]
        except ValueError:
            raise ValueError(f"--sweep-mem {args.sweep_mem!r} must be integers like 0,64,128") from None
        print(f"{'mem_len':>8} {'attn_len':>8} {'loss':>8} {corpus.metric:>8} {'tokens/s':>10}")
        results = []
        for m in mems:
            r = evaluate(model, tokens, mem_len=m, **kwargs)
            results.append(r)
            print(f"{m:>8} {m + kwargs['tgt_len']:>8} {r.loss:>8.4f} {r.value:>8.4f} {r.tokens_per_s:>10,.0f}")
        plot = args.plot or str(Path(loaded.path) / "mem_sweep.png")
        if plot_sweep(mems, results, kwargs["tgt_len"], plot):
            print(f"plot: {plot}")
        return 0
    mem = args.mem_len if args.mem_len is not None else e.mem_len
    r = evaluate(model, tokens, mem_len=mem, **kwargs)
    print(f"mem_len {mem if mem is not None else run_cfg.model.mem_len}, tgt_len {kwargs['tgt_len']}: "
          f"{r.describe()}")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Refuse out-of-range numbers before loading anything (0 must not silently mean "the default")."""
    for flag, value, minimum in (("--batch-size", args.batch_size, 1), ("--tgt-len", args.tgt_len, 1),
                                 ("--mem-len", args.mem_len, 0), ("--ext-len", args.ext_len, 0),
                                 ("--max-batches", args.max_batches, 0)):
        if value is not None and value < minimum:
            default = "; leave it out for the run's own" if flag in ("--batch-size", "--tgt-len", "--mem-len") else ""
            raise ValueError(f"{flag} {value} must be >= {minimum}{default}")
