"""`txl generate`: continue a prompt, printing the text as it is produced."""

from __future__ import annotations

import argparse
import sys


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Arguments shared by `txl generate` and `txl score`: the model, its vocabulary, the context."""
    p.add_argument("--checkpoint", required=True, metavar="DIR|REPO_ID",
                   help="a txl checkpoint or training run directory (its best checkpoint), a Hugging "
                   "Face transfo-xl directory, or a Hub repo id (e.g. transfo-xl/transfo-xl-wt103)")
    p.add_argument("--revision", default=None, help="Hub repo revision: branch, tag or commit (default main)")
    p.add_argument("--vocab", metavar="FILE", help="vocabulary file, when the checkpoint holds none "
                   "(Hugging Face plain text: one word per line, or JSON)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a pickled vocab.pkl/vocab.bin (only if you trust its origin)")
    p.add_argument("--pretokenized", action="store_true",
                   help="word-level text is already split into tokens (e.g. WikiText files): split on spaces only")
    p.add_argument("--mem-len", type=int, help="memory length (generate: whole context by default; "
                   "score: the checkpoint's)")
    p.add_argument("--segment-len", type=int, default=None, help="tokens read per forward pass")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")


def load_model_and_tokenizer(args: argparse.Namespace):
    from pathlib import Path

    import txl
    from txl.data.tokenizer import load_model_tokenizer
    from txl.distributed import resolve_device
    from txl.pretrained import resolve_model_dir

    device = resolve_device(args.device)
    if args.vocab is not None and not Path(args.vocab).is_file():
        raise FileNotFoundError(f"--vocab {args.vocab} is not a file: pass the vocabulary (vocab.txt, one word a "
                                "line, or JSON)")
    # A run directory: its best, else latest, checkpoint; a Hub repo id: its snapshot in the Hub cache.
    directory = resolve_model_dir(args.checkpoint, revision=args.revision)
    model = txl.from_pretrained(directory, device=device)
    tokenizer = load_model_tokenizer(directory, vocab_size=model.config.vocab_size, vocab_file=args.vocab,
                                     allow_pickle=args.allow_pickle, pretokenized=args.pretokenized)
    return model, tokenizer


def read_text_file(path: str, what: str) -> str:
    """A UTF-8 text file's content, or a ValueError/FileNotFoundError naming the file and the fix."""
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{what} {path} is {'a directory' if file.is_dir() else 'missing'}: "
                                "pass a text file")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {err.start}: {err.reason}); convert it, "
                         "e.g. iconv -f latin1 -t utf-8") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model, streaming the text")
    add_checkpoint_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the smallest set with this mass (1: all)")
    p.add_argument("--seed", type=int, help="random seed, for reproducible samples")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (cut before it); repeat for several")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 lowers the scores of tokens already read or written (CTRL; 1: off)")
    p.add_argument("--compile", action="store_true", help="run the forward through torch.compile")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from txl.generate import check_sampling, generate_stream

    # Cheap checks first: a typo should not cost loading a model.
    check_sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, repetition_penalty=args.repetition_penalty)
    if any(not s for s in args.stop):
        raise ValueError("--stop needs a non-empty text")
    text = args.prompt if args.prompt is not None else read_text_file(args.prompt_file, "--prompt-file")
    if not text.strip():
        raise ValueError("the prompt is empty: give some text with --prompt TEXT or --prompt-file FILE")
    model, tokenizer = load_model_and_tokenizer(args)
    ids = tokenizer.encode_prompt(text)
    if not ids:
        raise ValueError("the prompt has no tokens after tokenisation: give some words")
    stream = tokenizer.stream()
    tokens = generate_stream(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, mem_len=args.mem_len,
                             segment_len=256 if args.segment_len is None else args.segment_len,
                             stop_strings=args.stop, decode=tokenizer.decode,
                             repetition_penalty=args.repetition_penalty, compile=args.compile)
    # A prompt that ends mid-line continues on the same line.
    out = sys.stdout
    if tokenizer.level == "word" and not text.endswith("\n"):
        out.write(" ")
    # Text that could still be the start of a stop string is held back until the next token decides.
    hold = max((len(s) for s in args.stop), default=1) - 1
    pending = ""
    for token in tokens:
        if int(token[0]) < 0:  # the row stopped
            break
        pending += stream.push(int(token[0]))
        cut = min((pending.find(s) for s in args.stop if s in pending), default=-1)
        if cut >= 0:
            out.write(pending[:cut] + "\n")
            out.flush()
            return 0
        shown = len(pending) - hold if hold else len(pending)
        out.write(pending[:max(shown, 0)])
        pending = pending[max(shown, 0):]
        out.flush()
    pending += stream.finish()
    cut = min((pending.find(s) for s in args.stop if s in pending), default=-1)
    out.write((pending if cut < 0 else pending[:cut]) + "\n")
    out.flush()
    return 0
