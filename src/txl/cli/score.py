"""`txl score FILE...`: per-token log-probabilities (JSONL) and each file's perplexity or bits per character."""

from __future__ import annotations

import argparse
import sys

from txl.cli.generate import add_checkpoint_args, add_shortcut, run_section
from txl.config import SCORE_SEGMENT_LEN


def add_parser(sub: argparse._SubParsersAction) -> None:
    from txl.cli.options import add_config_arguments

    p = sub.add_parser(
        "score", help="score documents: per-token log-probabilities, perplexity or bits/char", allow_abbrev=False,
        description="Score documents with memory carried through each one. The context is set as --eval.FIELD "
        "VALUE, as in txl eval (a run's own [eval] settings are the defaults), with shortcuts for the common "
        "fields, e.g. --mem-len 512 --segment-len 128.")
    add_checkpoint_args(p)
    p.add_argument("files", nargs="+", metavar="FILE", help="documents to score, one per file")
    p.add_argument("--output", "-o", default=None, metavar="FILE",
                   help="write JSONL of token scores and document totals (in the order the files are given) to FILE "
                   "('-': standard output); "
                   "without it, one summary line per document is printed")
    p.add_argument("--totals-only", action="store_true", help="write only each document's totals")
    add_shortcut(p, "--batch-size", "eval.batch_size", metavar="N")
    add_shortcut(p, "--segment-len", "eval.tgt_len", metavar="N")
    add_shortcut(p, "--mem-len", "eval.mem_len", metavar="M")
    add_shortcut(p, "--clamp-len", "eval.clamp_len", metavar="C")
    add_shortcut(p, "--same-length", "eval.same_length", action=argparse.BooleanOptionalAction)
    add_shortcut(p, "--graphs", "eval.graphs", action=argparse.BooleanOptionalAction)
    add_config_arguments(p, ["eval"])
    p.set_defaults(func=run)


SEGMENT_LEN = SCORE_SEGMENT_LEN
"""Tokens per forward pass when neither the option nor the run's [eval] section gives one."""


def eval_config(args: argparse.Namespace, directory=None):
    """The ``EvalConfig`` of this call: the run's ``[eval]`` (when ``directory`` belongs to a run), then the
    options given. Called once without a directory to refuse a bad option before a model is loaded."""
    from txl.cli.options import overrides_from
    from txl.config import EvalConfig
    from txl.presets import apply_overrides

    base = {"eval": run_section(directory, "eval") if directory is not None else {}}
    e = EvalConfig(**apply_overrides(base, overrides_from(args))["eval"])
    if e.ext_len:
        raise ValueError(f"eval.ext_len={e.ext_len}: txl score reads each document from its start without "
                         "an extended context; drop --eval.ext_len")
    return e


def _lines(path: str):
    """The file's lines, read lazily; a non-UTF-8 file is named in the error."""
    with open(path, encoding="utf-8") as f:
        try:
            yield from f
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} is not UTF-8 text ({err.reason}); convert it, e.g. iconv -f latin1 "
                             "-t utf-8, and score it again") from None


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from txl.cli.generate import load_model_and_tokenizer
    from txl.fileio import check_output, write_output
    from txl.score import DocumentScore, iter_scores

    for path in args.files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} is not a file: pass the documents to score")
    if args.output not in (None, "-"):  # a file: check it can be written before loading anything
        check_output(args.output, "-o", "scores.jsonl")
    eval_config(args)  # a bad option is refused before a model is loaded
    model, codec, directory = load_model_and_tokenizer(args)
    e = eval_config(args, directory)
    docs = [codec.encode_lines(_lines(path)) for path in args.files]  # read lazily, line by line
    unit = {"word": "ppl", "bpe": "ppl", "char": "bpc", "byte": "bpc"}[codec.level]
    segment_len, ctx = e.segment_len(SEGMENT_LEN), e.context(model.config)
    context = f"segment_len {segment_len}, {ctx.describe(model=model.config)}"
    summary = sys.stdout if args.output is None else sys.stderr  # the JSONL owns stdout when -o - is given

    def score(out) -> None:
        # Documents read together finish in any order (the shortest first): each one's totals (its summary line
        # and its JSONL totals row) wait until those of every document given before it are out.
        finished: dict[int, tuple[str, dict]] = {}
        written = 0
        for item in iter_scores(model, docs, segment_len=segment_len, batch_size=e.batch_size,
                                mem_len=ctx.mem_len, clamp_len=ctx.clamp_len, same_length=ctx.same_length,
                                context_id=codec.context_id, graphs=e.graphs):
            name = args.files[item.doc]
            if isinstance(item, DocumentScore):
                if item.n_tokens == 0:  # nothing to score: no figure (a NaN is not a measurement)
                    line = f"{name}: 0 tokens (empty after tokenisation; not scored)"
                    total = {"doc": name, "tokens": 0, "nll": 0.0, unit: None, "bits_per_token": None}
                else:
                    value = item.perplexity if unit == "ppl" else item.bits_per_token
                    line = f"{name}: {item.n_tokens} tokens, {unit} {value:.4f} ({context})"
                    total = {"doc": name, "tokens": item.n_tokens, "nll": item.nll, unit: value,
                             "bits_per_token": item.bits_per_token}
                finished[item.doc] = (line, total)
                while written in finished:
                    line, total = finished.pop(written)
                    print(line, file=summary, flush=True)
                    if out is not None:
                        out.write(json.dumps(total) + "\n")
                    written += 1
            elif out is not None and not args.totals_only:
                for pos, (tid, lp) in enumerate(zip(item.token_ids, item.logprobs), start=item.start):
                    out.write(json.dumps({"doc": name, "pos": pos, "token": codec.token_text(tid),
                                          "logprob": round(float(lp), 6)}, ensure_ascii=False) + "\n")
            if out is not None:
                out.flush()

    def to_file(tmp) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            score(f)

    try:
        if args.output in (None, "-"):
            score(None if args.output is None else sys.stdout)
        else:  # written whole or not at all (txl.fileio's output rule): a full disk leaves no half file
            write_output(args.output, to_file)
    except BrokenPipeError:  # the reader stopped early (`| head`): not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 0
