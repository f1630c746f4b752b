"""`txl generate`: continue a prompt, printing the text as it is produced."""

from __future__ import annotations

import argparse
import sys


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Arguments shared by `txl generate` and `txl score`: the model and its vocabulary."""
    p.add_argument("--checkpoint", required=True, metavar="DIR|REPO_ID",
                   help="a txl checkpoint or training run directory (its best checkpoint), a Hugging "
                   "Face transfo-xl directory, or a Hub repo id (e.g. transfo-xl/transfo-xl-wt103)")
    p.add_argument("--revision", default=None, help="Hub repo revision: branch, tag or commit (default main)")
    add_vocab_argument(p)
    p.add_argument("--pretokenized", action="store_true",
                   help="word-level text is already split into tokens (e.g. WikiText files): split on spaces only")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")


def add_vocab_argument(p: argparse.ArgumentParser, flag: str = "--vocab") -> None:
    """The one vocabulary option of every command that reads a checkpoint's vocabulary (generate, score,
    eval --checkpoint, train --init-from)."""
    p.add_argument(flag, metavar="FILE", default=None, help="vocabulary file to use instead of the checkpoint's "
                   "(Hugging Face plain text: one word a line, JSON, or vocab.pkl, read with a restricted "
                   "unpickler that builds only plain containers)")


def add_shortcut(p: argparse.ArgumentParser, flag: str, field: str, **kwargs) -> None:
    """``flag`` as a shortcut for ``--SECTION.FIELD``: it lands in the same place, as a string, and is typed
    and checked by the section's dataclass like the long form (one convention, one set of errors)."""
    action = p.add_argument(flag, dest=field, default=argparse.SUPPRESS, help=f"shortcut for --{field}", **kwargs)
    # Both given (--max-steps 5 --train.max_steps 7) would silently keep the last: the entry point refuses it.
    p.set_defaults(shortcuts={**(p.get_default("shortcuts") or {}), **dict.fromkeys(action.option_strings, field)})


def run_section(directory, section: str) -> dict:
    """The ``[section]`` of the run a checkpoint directory belongs to ({} for a model without a run)."""
    from txl.checkpoint import RUN_FILE, read_run

    if not (directory / RUN_FILE).is_file():
        return {}
    return read_run(directory).to_dict()[section]  # checked: a damaged run.json is refused, not defaulted


def load_model_and_tokenizer(args: argparse.Namespace):
    """The model, its tokenizer and the directory they were read from (a checkpoint or model directory)."""
    import txl
    from txl.data.tokenizer import load_model_tokenizer
    from txl.distributed import resolve_device
    from txl.pretrained import resolve_model_dir

    device = resolve_device(args.device)
    # A run directory: its best, else latest, checkpoint; a Hub repo id: its snapshot in the Hub cache.
    directory = resolve_model_dir(args.checkpoint, revision=args.revision)
    model = txl.from_pretrained(directory, device=device)
    tokenizer = load_model_tokenizer(directory, vocab_size=model.config.vocab_size, vocab_file=args.vocab,
                                     pretokenized=args.pretokenized)
    return model, tokenizer, directory


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
    from txl.cli.options import add_config_arguments

    p = sub.add_parser(
        "generate", help="continue a prompt with a trained model, streaming the text", allow_abbrev=False,
        description="Continue a prompt. Sampling is set as --sample.FIELD VALUE (a run's own [sample] settings "
        "are the defaults), with shortcuts for the common fields, e.g. --temperature 0.8 --top-p 0.9.")
    add_checkpoint_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    add_shortcut(p, "--max-new-tokens", "sample.max_new_tokens", metavar="N")
    add_shortcut(p, "--temperature", "sample.temperature", metavar="T")
    add_shortcut(p, "--top-k", "sample.top_k", metavar="K")
    add_shortcut(p, "--top-p", "sample.top_p", metavar="P")
    add_shortcut(p, "--repetition-penalty", "sample.repetition_penalty", metavar="R")
    add_shortcut(p, "--seed", "sample.seed", metavar="N")
    add_shortcut(p, "--stop", "sample.stop", metavar="TEXT", action="append")
    add_shortcut(p, "--mem-len", "sample.mem_len", metavar="M")
    add_shortcut(p, "--segment-len", "sample.segment_len", metavar="N")
    add_shortcut(p, "--compile", "sample.compile", action="store_const", const="true")
    add_config_arguments(p, ["sample"])
    p.set_defaults(func=run)


def sample_config(args: argparse.Namespace, directory=None):
    """The ``SampleConfig`` of this call: the run's ``[sample]`` (when ``directory`` belongs to a run), then
    the options given. Called once without a directory to refuse a bad option before a model is loaded."""
    from txl.cli.options import overrides_from
    from txl.config import SampleConfig
    from txl.presets import apply_overrides

    base = {"sample": run_section(directory, "sample") if directory is not None else {}}
    return SampleConfig(**apply_overrides(base, overrides_from(args))["sample"])


def run(args: argparse.Namespace) -> int:
    import signal

    from txl.data.tokenizer.stream import TextStream
    from txl.decoding import StopText
    from txl.generation import generate_stream
    from txl.signals import GENERATED, Interrupted

    sample_config(args)  # cheap checks first: a typo should not cost loading a model
    text = args.prompt if args.prompt is not None else read_text_file(args.prompt_file, "--prompt-file")
    if not text.strip():
        raise ValueError("the prompt is empty: give some text with --prompt TEXT or --prompt-file FILE")
    model, tokenizer, directory = load_model_and_tokenizer(args)
    s = sample_config(args, directory)
    ids = tokenizer.encode_prompt(text)
    if not ids:
        raise ValueError("the prompt has no tokens after tokenisation: give some words")
    tokens = generate_stream(model, ids, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                             top_k=s.top_k, top_p=s.top_p, seed=s.seed, mem_len=s.mem_len,
                             segment_len=s.segment_len, stop_strings=s.stop, decode=tokenizer.decode,
                             repetition_penalty=s.repetition_penalty, compile=s.compile)
    # The text the new tokens add to the prompt's (a prompt that ends mid-line continues on the same line, after
    # a space for words); text that could still begin a stop string is held back until the next token decides.
    stream = TextStream(tokenizer, context=ids)
    stops = StopText(s.stop)
    out = sys.stdout
    shown = False
    try:
        for token in tokens:
            if int(token[0]) < 0:  # the row stopped
                break
            if stops.push(stream.push(int(token[0]))):
                break
            text = stops.show()
            out.write(text)
            out.flush()
            shown = shown or bool(text)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the line says whether any text came before it
        if not shown:
            raise  # INTACT's line: nothing was generated
        out.write("\n")
        out.flush()
        raise Interrupted(err.signal if isinstance(err, Interrupted) else signal.SIGINT, intact=GENERATED) from err
    if not stops.stopped:
        stops.push(stream.finish())
    out.write(stops.finish() + "\n")
    out.flush()
    return 0
