"""`txl eval`: evaluate a checkpoint in any attention context; sweep the memory length.

    txl eval runs/default                          # best checkpoint, test split, the run's eval context
    txl eval runs/ptb --mem-len 512 --clamp-len 400 --same-length --tgt-len 64
    txl eval runs/default --sweep-mem 0,32,64,128,256 --plot sweep.png
    txl eval --checkpoint transfo-xl/transfo-xl-wt103 --corpus wt103 --split test   # the published 18.3

A model directory without a run (a Hugging Face transfo-xl directory or Hub repo id, or a txl model saved
by save_pretrained) is evaluated on ``--corpus`` with its own vocabulary (the corpus files are read as
pretokenized words, ``<eos>`` per line) and its own context: a Hugging Face wt103 checkpoint carries the
paper's (mem_len 1600, clamp_len 1000, same_length), with tgt_len 128 and 10 streams as the original
evaluation script reads the split.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (loss, ppl or bpc, tokens/s)")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="run directory (uses best.json, else latest.json), checkpoint or model directory, or "
                   "Hugging Face Hub repo id")
    p.add_argument("--checkpoint", dest="checkpoint_opt", metavar="DIR|REPO_ID", default=None,
                   help="the same, as an option")
    p.add_argument("--revision", default=None, help="Hub repo revision: branch, tag or commit (default main)")
    p.add_argument("--which", choices=["best", "latest"], default="best", help="which checkpoint of a run")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--corpus", default=None, help="corpus name or path (default: the run's)")
    p.add_argument("--data-dir", default=None, help="folder of a named corpus (default: the run's)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="parallel streams (default: the run's eval; 10 for a model directory)")
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


# The original evaluation script's defaults for a checkpoint without a run (kimiyoung/transformer-xl
# pytorch/eval.py and run_wt103_*.sh: --tgt_len 128, --batch_size 10); the memory context is the model's.
PRETRAINED_TGT_LEN = 128
PRETRAINED_BATCH_SIZE = 10


def _pretrained_tokens(directory, corpus: str, data_dir: str | None, split: str):
    """The split of a named corpus (or a train/valid/test folder) encoded with the checkpoint's vocabulary."""
    from pathlib import Path

    import numpy as np

    from txl.data.corpora import get_spec, resolve_sources
    from txl.data.tokenizer import load_model_tokenizer

    codec = load_model_tokenizer(directory, pretokenized=True)
    spec, _ = get_spec(corpus)
    folder = Path(data_dir) if data_dir else (Path(corpus) if Path(corpus).is_dir() else Path("data") / spec.name)
    ids: list[int] = []
    for source in resolve_sources(spec, folder)[split]:
        with open(source.path, encoding="utf-8") as f:
            ids.extend(codec.encode_lines(f))
    tokens = np.asarray(ids, dtype=np.int64)
    unk = getattr(getattr(codec, "vocab", None), "unk_id", None)
    n_unk = int((tokens == unk).sum()) if unk is not None else 0
    return tokens, spec, codec, n_unk


def run_pretrained(args: argparse.Namespace, directory, device) -> int:
    """Evaluate a model directory that has no run config: the checkpoint's vocabulary and context."""
    import json

    import txl
    from txl.evaluate import evaluate
    from txl.runtime import resolve_precision

    if not args.corpus:
        raise ValueError(f"{directory} is a model without a training run: name the corpus to evaluate on with "
                         "--corpus NAME|PATH (e.g. --corpus wt103 --data-dir data/wt103)")
    if args.sweep_mem:
        raise ValueError("--sweep-mem needs a run directory; evaluate a model directory one --mem-len at a time")
    model = txl.from_pretrained(directory, device=device)
    tokens, spec, codec, n_unk = _pretrained_tokens(directory, args.corpus, args.data_dir, args.split)
    if codec.vocab_size != model.config.vocab_size:
        raise ValueError(f"the vocabulary in {directory} has {codec.vocab_size} symbols but the model has "
                         f"vocab_size={model.config.vocab_size}; it does not belong to this checkpoint")
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    c = model.config
    tgt_len = args.tgt_len or raw.get("tgt_len") or PRETRAINED_TGT_LEN
    mem = args.mem_len if args.mem_len is not None else c.mem_len
    clamp = args.clamp_len if args.clamp_len is not None else c.clamp_len
    same = args.same_length if args.same_length is not None else c.same_length
    print(f"{args.checkpoint_dir} on {spec.name} {args.split}: {len(tokens):,} tokens with the checkpoint's "
          f"vocabulary ({codec.vocab_size:,} symbols, {n_unk:,} <unk>); tgt_len {tgt_len}, mem_len {mem}, "
          f"clamp_len {clamp}, same_length {same}")
    r = evaluate(model, tokens, metric=spec.metric, batch_size=args.batch_size or PRETRAINED_BATCH_SIZE,
                 tgt_len=tgt_len, mem_len=mem, clamp_len=clamp, same_length=same, ext_len=args.ext_len,
                 max_batches=args.max_batches, precision=resolve_precision(args.precision, device))
    print(f"{args.split}: {r.describe()}")
    return 0


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from txl.checkpoint import RUN_FILE, check_tokenizer, find_checkpoint, load_checkpoint
    from txl.data.corpora import load_run_corpus
    from txl.distributed import resolve_device
    from txl.evaluate import evaluate, plot_sweep
    from txl.pretrained import resolve_model_dir
    from txl.runtime import resolve_precision

    if (args.checkpoint is None) == (args.checkpoint_opt is None):
        raise ValueError("give the checkpoint once: txl eval DIR, or txl eval --checkpoint DIR|REPO_ID")
    args.checkpoint_dir = args.checkpoint or args.checkpoint_opt
    device = resolve_device(args.device)
    directory = resolve_model_dir(args.checkpoint_dir, revision=args.revision, which=args.which)
    if not (directory / RUN_FILE).is_file():
        return run_pretrained(args, directory, device)
    args.checkpoint = str(directory)
    loaded = load_checkpoint(directory, which=args.which, with_state=False, device=device)
    run_cfg, model = loaded.run, loaded.model
    data = run_cfg.data
    if args.corpus or args.data_dir:
        from dataclasses import replace
        data = replace(data, corpus=args.corpus or data.corpus, data_dir=args.data_dir or data.data_dir)
    corpus = load_run_corpus(data)
    check_tokenizer(find_checkpoint(args.checkpoint, args.which), corpus.tokenizer)
    e = run_cfg.eval
    kwargs = dict(metric=corpus.metric, batch_size=args.batch_size or e.batch_size,
                  tgt_len=args.tgt_len or e.tgt_len or run_cfg.train.tgt_len,
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
