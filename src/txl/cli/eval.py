"""`txl eval`: evaluate a checkpoint in any attention context; sweep the memory length.

    txl eval runs/default                          # best checkpoint, TEST split, the run's eval context
    txl eval runs/ptb --eval.mem_len 512 --eval.clamp_len 400 --eval.same_length --eval.tgt_len 64
    txl eval runs/default --sweep-mem 0,32,64,128,256   # table + plot in the run directory
    txl eval --checkpoint transfo-xl/transfo-xl-wt103 --corpus wt103 --split test   # the published 18.3

A model directory without a run (a Hugging Face transfo-xl directory or Hub repo id, or a txl model saved
by save_pretrained) is evaluated on ``--corpus`` with its own vocabulary (the corpus files are read as
pretokenized words, ``<eos>`` per line) and its own context: a Hugging Face wt103 checkpoint carries the
paper's (mem_len 1600, clamp_len 1000, same_length), with tgt_len 128 and 10 streams as the original
evaluation script reads the split.
"""

from __future__ import annotations

import argparse

from txl.cli.generate import add_shortcut, add_vocab_argument
from txl.cli.options import add_config_arguments, overrides_from


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a checkpoint on the test split (loss, ppl or bpc, tokens/s)", allow_abbrev=False,
        usage="txl eval CHECKPOINT|--checkpoint DIR|REPO_ID [--corpus NAME] [--split {valid,test}] "
        "[--sweep-mem M1,M2,...] [--eval.FIELD VALUE ...]",
        description="Evaluate a checkpoint on the TEST split by default (--split valid for validation), in the "
        "run's evaluation context ([eval] of its config; unset fields: as in training), computed as the run was "
        "([compute]). Any eval, data or compute field can be overridden as --SECTION.FIELD VALUE, e.g. "
        "--eval.mem_len 512 --eval.same_length --compute.attn_impl reference.")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="run directory (uses best.json, else latest.json), checkpoint or model directory, or "
                   "Hugging Face Hub repo id")
    p.add_argument("--checkpoint", dest="checkpoint_opt", metavar="DIR|REPO_ID", default=None,
                   help="the same, as an option")
    p.add_argument("--revision", default=None, help="Hub repo revision: branch, tag or commit (default main)")
    add_vocab_argument(p)  # a checkpoint without a training run: its vocabulary, else this file
    add_shortcut(p, "--corpus", "data.corpus", metavar="NAME|PATH")  # needed for a model directory without a run
    add_shortcut(p, "--data-dir", "data.data_dir", metavar="DIR")
    p.add_argument("--which", choices=["best", "latest"], default="best", help="which checkpoint of a run")
    p.add_argument("--split", choices=["valid", "test"], default="test", help="split to evaluate (default: test)")
    p.add_argument("--max-batches", type=int, default=0, help="stop after this many segments (0: all)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="fp32",
                   help="fp32 (default, exact); auto: bf16 on a GPU that supports it, else fp32")
    p.add_argument("--compile", action="store_true", help="run the forward through torch.compile")
    p.add_argument("--graphs", action="store_true",
                   help="every segment captured as a CUDA graph over key/value rings (txl.static_eval; as "
                        "--eval.graphs)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--sweep-mem", default=None, metavar="M1,M2,...",
                   help="evaluate once per memory length; table (mem_sweep.tsv) and plot (mem_sweep.png) go into "
                   "the run directory")
    p.add_argument("--plot", default=None, help="sweep plot path (default: RUN_DIR/mem_sweep.png)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bars of the evaluated segments (and of the sweep)")
    add_config_arguments(p, ["eval", "data", "compute"])
    p.set_defaults(func=run)


def keys_per_query(mem_len: int, tgt_len: int, same_length: bool, style: str, cmem_len: int = 0) -> str:
    """What each query attends to: with same_length every query sees the same number of keys (mem_len in
    the PyTorch/Hugging Face mask, mem_len + 1 in the TensorFlow one); without it, query t of a segment sees
    the memory and the t + 1 positions up to itself, and a compressive model's cmem_len compressed slots before
    them once they are filled (Rae et al. 2020: every layer attends over [compressed; memory; segment])."""
    if same_length:
        return str(mem_len + (style == "tensorflow"))
    return f"{cmem_len + mem_len + 1}-{cmem_len + mem_len + tgt_len}"


# The original evaluation script's defaults for a checkpoint without a run (kimiyoung/transformer-xl
# pytorch/eval.py and run_wt103_*.sh: --tgt_len 128, --batch_size 10); the memory context is the model's.
PRETRAINED_TGT_LEN = 128
PRETRAINED_BATCH_SIZE = 10


def _pretrained_tokens(directory, corpus: str, data_dir: str | None, split: str, vocab: str | None = None,
                       vocab_size: int | None = None):
    """The split of a named corpus (or a train/valid/test folder) encoded with the checkpoint's vocabulary."""
    from pathlib import Path

    import numpy as np

    from txl.data.corpora import get_spec, resolve_sources
    from txl.data.tokenizer import load_model_tokenizer

    codec = load_model_tokenizer(directory, vocab_file=vocab, pretokenized=True, vocab_size=vocab_size)
    spec, _ = get_spec(corpus)
    folder = Path(data_dir) if data_dir else (Path(corpus) if Path(corpus).is_dir() else Path("data") / spec.name)
    ids: list[int] = []
    for source in resolve_sources(spec, folder)[split]:
        with open(source.path, encoding="utf-8") as f:
            ids.extend(codec.encode_lines(f, final_eos=True))  # a corpus file, as training reads one
    tokens = np.asarray(ids, dtype=np.int64)
    unk = getattr(getattr(codec, "vocab", None), "unk_id", None)
    n_unk = int((tokens == unk).sum()) if unk is not None else 0
    return tokens, spec, codec, n_unk


def run_pretrained(args: argparse.Namespace, directory, device) -> int:
    """Evaluate a model directory that has no run config: the checkpoint's vocabulary and context, with the
    --eval.FIELD options given on the command line taking precedence."""
    import json

    import txl
    from txl.config import ComputeConfig, EvalConfig
    from txl.evaluate import check_split_fits, evaluate
    from txl.presets import apply_overrides
    from txl.runtime import resolve_precision

    given = apply_overrides({}, overrides_from(args))  # only the options given, typed
    data, ev = given.get("data", {}), given.get("eval", {})
    if not data.get("corpus"):
        raise ValueError(f"{directory} is a model without a training run: name the corpus to evaluate on with "
                         "--corpus NAME|PATH (e.g. --corpus wt103 --data-dir data/wt103)")
    if args.sweep_mem:
        raise ValueError("--sweep-mem needs a run directory; evaluate a model directory one --eval.mem_len at "
                         "a time")
    model = txl.from_pretrained(directory, device=device, compute=ComputeConfig(**given.get("compute", {})))
    tokens, spec, codec, n_unk = _pretrained_tokens(directory, data["corpus"], data.get("data_dir"), args.split,
                                                    args.vocab, model.config.vocab_size)
    if codec.vocab_size != model.config.vocab_size:
        raise ValueError(f"the vocabulary in {directory} has {codec.vocab_size} symbols but the model has "
                         f"vocab_size={model.config.vocab_size}; it does not belong to this checkpoint")
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    e = EvalConfig(**{"batch_size": PRETRAINED_BATCH_SIZE, **ev, **flags(args, ev)})
    tgt_len, context = e.segment_len(raw.get("tgt_len") or PRETRAINED_TGT_LEN), e.context(model.config)
    print(f"{args.checkpoint} on {spec.name} {args.split}: {len(tokens):,} tokens with the checkpoint's "
          f"vocabulary ({codec.vocab_size:,} symbols, {n_unk:,} <unk>); {e.batch_size} streams, tgt_len {tgt_len}, "
          f"{context.describe(model=model.config)}")
    from txl.metrics import segment_progress

    check_split_fits(args.split, len(tokens), batch_size=e.batch_size, tgt_len=tgt_len, flag="--eval.tgt_len")
    with segment_progress(args.progress, args.split) as on_segment:
        r = evaluate(model, tokens, metric=spec.metric, batch_size=e.batch_size, tgt_len=tgt_len, context=context,
                     max_batches=args.max_batches,
                     precision=resolve_precision(args.precision, device), compile=e.compile, graphs=e.graphs,
                     on_segment=on_segment)
    print(f"{args.split}: {r.describe()}")
    return 0


def flags(args: argparse.Namespace, ev: dict) -> dict[str, bool]:
    """--compile and --graphs folded into the evaluation config's fields of the same names (either turns one on),
    so that EvalConfig's one rule sees them whichever way they were given."""
    return {"compile": args.compile or bool(ev.get("compile")), "graphs": args.graphs or bool(ev.get("graphs"))}


def run(args: argparse.Namespace) -> int:
    import logging
    import sys
    from dataclasses import replace

    from txl.checkpoint import RUN_FILE, check_tokenizer, find_checkpoint, load, read_run
    from txl.config import RunConfig
    from txl.data.corpora import load_run_corpus
    from txl.distributed import resolve_device
    from txl.evaluate import check_split_fits, evaluate
    from txl.fileio import check_output, write_output
    from txl.metrics import ProgressBar, plot_memory_sweep, segment_progress
    from txl.presets import apply_overrides
    from txl.pretrained import resolve_model_dir
    from txl.rundir import run_dir_of
    from txl.runtime import resolve_precision

    if args.max_batches < 0:
        raise ValueError(f"--max-batches {args.max_batches} must be >= 0 (0: the whole split)")
    if args.graphs and args.compile:
        raise ValueError("--graphs already compiles (static shapes through torch.compile's CUDA graphs): give "
                         "--graphs or --compile, not both")
    if (args.checkpoint is None) == (args.checkpoint_opt is None):
        raise ValueError("give the checkpoint once: txl eval DIR, or txl eval --checkpoint DIR|REPO_ID")
    args.checkpoint = args.checkpoint or args.checkpoint_opt
    device = resolve_device(args.device)
    directory = resolve_model_dir(args.checkpoint, revision=args.revision, which=args.which)
    if not (directory / RUN_FILE).is_file():
        return run_pretrained(args, directory, device)
    if args.vocab is not None:
        raise ValueError(f"--vocab {args.vocab}: {directory} belongs to a training run, which is evaluated with its "
                         "own saved tokenizer; drop --vocab")
    cfg = RunConfig.from_dict(apply_overrides(read_run(find_checkpoint(directory, args.which)).to_dict(),
                                              overrides_from(args)))
    loaded = load(directory, which=args.which, with_state=False, device=device, compute=cfg.compute)
    run_cfg, model = loaded.run, loaded.model
    corpus = load_run_corpus(replace(cfg.data))
    check_tokenizer(loaded.path, corpus.tokenizer)
    e, m = replace(cfg.eval, **flags(args, vars(cfg.eval))), model.config
    tgt, context = e.segment_len(cfg.train.tgt_len), e.context(m)
    same, clamp = context.same_length, context.clamp_len
    if clamp > 0 and not model.encoding.clamps_distances:
        logging.getLogger(__name__).warning(
            "eval.clamp_len=%d does not apply to attn_type=%r: %s", clamp, m.attn_type,
            "its distances are not clamped (Shaw's learned table stops at model.learned_positions; rotary angles "
            "grow with the distance)" if model.encoding.relative
            else "its learned positions have no distance to clamp")
    mems = [context.mem_len]
    if args.sweep_mem:
        try:
            mems = [int(x) for x in args.sweep_mem.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--sweep-mem {args.sweep_mem!r} must be integers like 0,64,128") from None
    if same and 0 in mems:
        raise ValueError("same_length with mem_len 0 masks every key of a segment's first query: drop "
                         "--eval.same_length (or 0 from --sweep-mem), or use a memory of at least 1")
    if m.cmem_len and 0 in mems:  # as ModelConfig refuses it for training
        raise ValueError(f"mem_len 0 with a compressive model (cmem_len {m.cmem_len}): its compressed memory is made "
                         "of the rows leaving the memory, and a memory of 0 rows keeps none to compress from; use "
                         f"--eval.mem_len >= 1 (it trained with {m.mem_len}), or drop 0 from --sweep-mem")
    kwargs = dict(metric=corpus.metric, batch_size=e.batch_size, tgt_len=tgt, max_batches=args.max_batches,
                  precision=resolve_precision(args.precision, device), compile=e.compile, graphs=e.graphs)
    tokens = corpus.split(args.split)
    check_split_fits("validation" if args.split == "valid" else "test", len(tokens), batch_size=e.batch_size,
                     tgt_len=tgt, flag="--eval.tgt_len" if e.tgt_len else "--train.tgt_len")
    plot = args.plot or str(run_dir_of(args.checkpoint) / "mem_sweep.png")
    if args.sweep_mem:  # the outputs are checked before the sweep spends its time
        check_output(run_dir_of(args.checkpoint) / "mem_sweep.tsv", "the sweep table", "mem_sweep.tsv")
        check_output(plot, "--plot", "mem_sweep.png")
    extent = f"first {args.max_batches} segments" if args.max_batches else "whole split"
    shown = context.describe(mem_len=args.sweep_mem if args.sweep_mem else None, model=m)
    print(f"{loaded.path} on {corpus.name} {args.split} ({extent}, {e.batch_size} streams, tgt_len {tgt}, {shown}; "
          f"trained with tgt_len {run_cfg.train.tgt_len}, mem_len {run_cfg.model.mem_len})")
    if not args.sweep_mem:
        with segment_progress(args.progress, args.split) as on_segment:
            r = evaluate(model, tokens, context=context, on_segment=on_segment, **kwargs)
        compressed = f"cmem_len {m.cmem_len}, " if m.cmem_len else ""
        print(f"mem_len {mems[0]}, {compressed}tgt_len {tgt}, keys/query "
              f"{keys_per_query(mems[0], tgt, same, m.same_length_style, m.cmem_len)}: {r.describe()}")
        return 0
    header = f"{'mem_len':>8} {'keys/query':>11} {'loss':>8} {corpus.metric:>8} {'tokens/s':>10}"
    rows, results = [header], []
    print(header, flush=True)
    bar = ProgressBar(total=len(mems), initial=0, enabled=args.progress, unit="mem_len", desc="sweep")
    try:
        for mem in mems:
            with segment_progress(args.progress, f"mem_len {mem}") as on_segment:
                r = evaluate(model, tokens, context=replace(context, mem_len=mem), on_segment=on_segment, **kwargs)
            results.append(r)
            rows.append(f"{mem:>8} {keys_per_query(mem, tgt, same, m.same_length_style, m.cmem_len):>11} "
                        f"{r.loss:>8.4f} "
                        f"{r.value:>8.4f} {r.tokens_per_s:>10,.0f}")
            bar.write(rows[-1], sys.stdout)
            bar.update(1)
    finally:
        bar.close()
    table = run_dir_of(args.checkpoint) / "mem_sweep.tsv"
    text = "\n".join("\t".join(r.split()) for r in rows) + "\n"
    write_output(table, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    print(f"table: {table}")
    before = f"{m.cmem_len} + " if m.cmem_len else ""  # the compressed slots, read before the memory
    keys = ("mem_len" + (" + 1" if m.same_length_style == "tensorflow" else "") if same
            else f"{before}mem_len + 1 .. {before}mem_len + {tgt}")
    if plot_memory_sweep(mems, [r.value for r in results], corpus.metric, keys, plot):
        print(f"plot: {plot}")
    return 0
