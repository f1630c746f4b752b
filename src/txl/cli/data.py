"""`txl data`: download a corpus, or encode one into the token cache and report its size."""

from __future__ import annotations

import argparse

from txl.config import add_config_arguments, overrides_from


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="download and prepare corpora")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    d = data_sub.add_parser("download", help="fetch, verify and unpack a named corpus")
    d.add_argument("name", help="corpus name (enwik8, text8, wt103, wt2, ptb, pennchar, lm1b)")
    d.add_argument("--dir", default=None, help="where to put it (default: data/NAME)")
    d.set_defaults(func=run_download)

    q = data_sub.add_parser("prepare", help="tokenise a corpus into the cache; print token counts",
                            allow_abbrev=False)
    q.add_argument("name", metavar="NAME_OR_PATH",
                   help="corpus name, a text file, or a pre-split directory with one train, valid and test file "
                   "(train.txt or train.tokens/.raw/.bin, or with a prefix: wiki.train.tokens; word level unless "
                   "--data.level says otherwise)")
    add_config_arguments(q, ["data"])
    q.set_defaults(func=run_prepare)


def run_download(args: argparse.Namespace) -> int:
    from txl.data.corpora import REGISTRY, download_corpus

    spec = REGISTRY.get(args.name)
    if spec is not None:
        for item in spec.downloads:
            if item.sha256 is None:
                print(f"note: no published sha256 is known for {item.url}; it will not be verified")
    path = download_corpus(args.name, args.dir)
    print(f"{args.name}: ready in {path}")
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    from txl.config import RunConfig, apply_overrides
    from txl.data.corpora import load_run_corpus

    data = RunConfig.from_dict(apply_overrides({"data": {"corpus": args.name}}, overrides_from(args))).data
    corpus = load_run_corpus(data)
    state = "cached" if corpus.cached else "encoded"
    print(f"{corpus.name}: {corpus.spec.level} level, vocab {corpus.vocab_size:,}, metric {corpus.metric} "
          f"({state} in {corpus.path})")
    for split in ("train", "valid", "test"):
        print(f"  {split:5s} {len(corpus.split(split)):>14,} tokens")
    return 0
