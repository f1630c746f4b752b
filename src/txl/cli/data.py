"""`txl data`: download a corpus, or encode one into the token cache and report its size."""

from __future__ import annotations

import argparse

from txl.cli.options import add_config_arguments, overrides_from


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="download and prepare corpora")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    d = data_sub.add_parser("download", help="fetch, verify and unpack a named corpus")
    d.add_argument("name", help="corpus name (enwik8, text8, wt103, wt2, ptb, pennchar, lm1b)")
    d.add_argument("--dir", default=None, help="where to put it (default: data/NAME)")
    d.add_argument("--from-file", default=None, metavar="ARCHIVE",
                   help="use an archive already downloaded (e.g. on another machine) instead of fetching it; "
                   "its checksum is verified")
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
            if item.sha256 is None and item.md5 is None:
                print(f"note: no published sha256 is known for {item.url}; it will not be verified")
    if args.from_file:
        _place_archive(args.name, args.dir, args.from_file)
    try:
        path = download_corpus(args.name, args.dir)
    except ConnectionError as err:  # offline, or the server is gone: say how to do without it
        import sys

        files = " ".join(item.filename for item in spec.downloads) if spec else "the archive"
        print(f"txl data: error: {err}. Check the network connection, or fetch {files} another way and run: "
              f"txl data download {args.name}{f' --dir {args.dir}' if args.dir else ''} --from-file FILE",
              file=sys.stderr)
        return 1
    print(f"{args.name}: ready in {path}")
    return 0


def _place_archive(name: str, directory: str | None, archive: str) -> None:
    """Put an archive downloaded by hand where the download would have (after checking its sha256), so
    the rest of `txl data download` (verify, unpack, check the files) runs unchanged."""
    import shutil
    from pathlib import Path

    from txl.data.corpora import REGISTRY
    from txl.data.download import sha256_of

    spec = REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown corpus {name!r}; corpora that can be downloaded: {', '.join(REGISTRY)}")
    source = Path(archive)
    if not source.is_file():
        raise FileNotFoundError(f"--from-file {archive} is not a file: pass the archive you downloaded")
    if len(spec.downloads) != 1:
        names = ", ".join(item.filename for item in spec.downloads)
        raise ValueError(f"{name} is made of {len(spec.downloads)} files ({names}); put them under those "
                         f"names in --dir and run txl data download {name} without --from-file")
    item = spec.downloads[0]
    digest = sha256_of(source)
    if item.sha256 is not None and digest != item.sha256.lower():
        raise ValueError(f"--from-file {archive} is not the {name} archive: its sha256 is {digest}, the "
                         f"published one {item.sha256} ({item.url}); download that file")
    dest = (Path(directory) if directory else Path("data") / name) / item.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists() or not dest.samefile(source):
        shutil.copyfile(source, dest)


def run_prepare(args: argparse.Namespace) -> int:
    from txl.config import RunConfig
    from txl.data.corpora import load_run_corpus
    from txl.presets import apply_overrides

    data = RunConfig.from_dict(apply_overrides({"data": {"corpus": args.name}}, overrides_from(args))).data
    corpus = load_run_corpus(data)
    state = "cached" if corpus.cached else "encoded"
    print(f"{corpus.name}: {corpus.spec.level} level, vocab {corpus.vocab_size:,}, metric {corpus.metric} "
          f"({state} in {corpus.path})")
    for split in ("train", "valid", "test"):
        print(f"  {split:5s} {len(corpus.split(split)):>14,} tokens")
    return 0
