"""Tokenisation levels: byte, char, word and BPE, each with a plain-dict spec.

A tokenizer's ``spec`` (a JSON-able dict) says how it was built: the level and its options, never
learned state. The spec goes into the token-cache key and is saved beside a model, so a changed
tokenisation is never silently reused. Learned state (the vocabulary, the BPE merges) is saved next
to it in the same directory::

    tokenizer.json   {"format": "txl-tokenizer", "spec": {...}, "vocab_size": N, "vocab_sha256": ...}
    vocab.txt        one symbol per line (byte with an observed vocabulary, char, word)
    bpe.json         the Hugging Face ``tokenizers`` model (BPE)

Levels:

* ``byte``: raw bytes. ``vocab="fixed"`` gives ids 0..255 = byte values; ``vocab="observed"`` keeps
  only the bytes seen in the training split, most frequent first (the enwik8 convention of the
  original code, whose symbols are the decimal byte values). ``drop_newlines`` drops byte 10.
* ``char``: Unicode characters of UTF-8 text; the vocabulary is the training split's characters.
* ``word``: whitespace-separated words, with ``<eos>`` at each line end as WikiText/PTB do; words not
  in the vocabulary map to ``<unk>`` when the vocabulary has it.
* ``bpe``: byte-level BPE trained with Hugging Face ``tokenizers`` (``pip install txl[cli]``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from txl.data.sources import Boundary, Source, iter_bytes, iter_text
from txl.data.vocab import BOS, EOS, UNK, Vocab

Level = Literal["byte", "char", "word", "bpe"]
LEVELS: tuple[str, ...] = ("byte", "char", "word", "bpe")
FORMAT = "txl-tokenizer"

_DEFAULTS: dict[str, dict[str, Any]] = {
    "byte": {"vocab": "fixed", "drop_newlines": False},
    "char": {"specials": [], "unk": None},
    "word": {"specials": [EOS], "unk": UNK, "eos": EOS, "bos": BOS, "add_eos": True, "add_bos": False,
             "lower_case": False, "min_freq": 1, "max_size": None, "vocab_file": None},
    "bpe": {"vocab_size": 8192, "min_frequency": 2},
}


def make_spec(level: str, **options: Any) -> dict[str, Any]:
    """A complete spec for ``level``: its defaults updated by ``options`` (unknown options rejected)."""
    if level not in _DEFAULTS:
        raise ValueError(f"unknown tokenisation level {level!r}; choose one of {', '.join(LEVELS)}")
    unknown = set(options) - set(_DEFAULTS[level])
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for level {level!r}; "
                         f"known: {sorted(_DEFAULTS[level])}")
    spec = {"level": level, **_DEFAULTS[level], **options}
    for key, value in spec.items():  # JSON has lists, not tuples: keep specs comparable after a round trip
        if isinstance(value, tuple):
            spec[key] = list(value)
    if level == "byte" and spec["vocab"] not in ("fixed", "observed"):
        raise ValueError(f"byte vocab must be 'fixed' or 'observed', got {spec['vocab']!r}")
    return spec


class Tokenizer(Protocol):
    spec: dict[str, Any]
    boundary: Boundary
    """How text may be cut into chunks without changing the encoding."""

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str | bytes) -> np.ndarray: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, directory: str | Path) -> None: ...


# -- byte ----------------------------------------------------------------------------------------------


class ByteTokenizer:
    boundary: Boundary = "byte"

    def __init__(self, spec: dict[str, Any], vocab: Vocab | None = None) -> None:
        self.spec = spec
        if (spec["vocab"] == "observed") != (vocab is not None):
            raise ValueError("a byte tokenizer with vocab='observed' needs its vocabulary, and only then")
        self.vocab = vocab
        self._table: np.ndarray | None = None  # byte value -> id (-1: not in the vocabulary)
        self._values: np.ndarray | None = None  # id -> byte value (-1: a special symbol)
        if vocab is not None:
            self._table = np.full(256, -1, dtype=np.int64)
            self._values = np.full(len(vocab), -1, dtype=np.int64)
            for i, s in enumerate(vocab.symbols):
                if s.isdigit() and int(s) < 256:
                    self._table[int(s)] = i
                    self._values[i] = int(s)

    @property
    def vocab_size(self) -> int:
        return 256 if self.vocab is None else len(self.vocab)

    def encode(self, text: str | bytes) -> np.ndarray:
        data = np.frombuffer(text.encode("utf-8") if isinstance(text, str) else text, dtype=np.uint8)
        if self.spec["drop_newlines"]:
            data = data[data != 10]
        if self._table is None:
            return data.astype(np.int64)
        ids = self._table[data]
        missing = ids < 0
        if missing.any():
            if self.vocab is None or self.vocab.unk_id is None:
                raise ValueError(f"byte {int(data[missing][0])} is not in the byte vocabulary (it never "
                                 "occurs in the training split); use vocab='fixed' to cover all 256 bytes")
            ids[missing] = self.vocab.unk_id
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        values = arr if self._values is None else self._values[arr]
        return bytes(values[values >= 0].astype(np.uint8))

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        _save(self, directory, self.vocab)


def _fit_byte(spec: dict[str, Any], train: Sequence[Source]) -> ByteTokenizer:
    if spec["vocab"] == "fixed":
        return ByteTokenizer(spec)
    counts = np.zeros(256, dtype=np.int64)
    for source in train:
        for _, block in iter_bytes(source):
            counts += np.bincount(np.frombuffer(block, dtype=np.uint8), minlength=256)
    if spec["drop_newlines"]:
        counts[10] = 0
    vocab = Vocab.from_counts({str(b): int(c) for b, c in enumerate(counts) if c > 0}, unk=None, eos=None,
                              bos=None)
    return ByteTokenizer(spec, vocab)


# -- char ----------------------------------------------------------------------------------------------


class CharTokenizer:
    boundary: Boundary = "char"

    def __init__(self, spec: dict[str, Any], vocab: Vocab) -> None:
        self.spec, self.vocab = spec, Vocab(vocab.symbols, unk=spec["unk"], eos=None, bos=None)
        # Sorted code points and their ids, so a whole chunk is looked up with one searchsorted.
        pairs = sorted((ord(s), i) for i, s in enumerate(vocab.symbols) if len(s) == 1)
        self._cps = np.array([p[0] for p in pairs], dtype=np.int64)
        self._ids = np.array([p[1] for p in pairs], dtype=np.int64)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        if not len(self._cps):
            pos, found = np.zeros_like(cps), np.zeros(len(cps), dtype=bool)
        else:
            pos = np.minimum(np.searchsorted(self._cps, cps), len(self._cps) - 1)
            found = self._cps[pos] == cps
        ids = self._ids[pos] if len(self._ids) else np.zeros(len(cps), dtype=np.int64)
        if not found.all():
            if self.vocab.unk_id is None:
                bad = chr(int(cps[~found][0]))
                raise ValueError(f"character {bad!r} is not in the character vocabulary; add '<unk>' to "
                                 "the specials (unk='<unk>') or use level='byte'")
            ids = np.where(found, ids, self.vocab.unk_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.vocab.decode(ids))

    def save(self, directory: str | Path) -> None:
        _save(self, directory, self.vocab)


def _fit_char(spec: dict[str, Any], train: Sequence[Source]) -> CharTokenizer:
    counts: Counter[str] = Counter()
    for source in train:
        for text in iter_text(source, "char"):
            cps, n = np.unique(np.frombuffer(text.encode("utf-32-le"), dtype="<u4"), return_counts=True)
            counts.update({chr(int(c)): int(k) for c, k in zip(cps, n, strict=True)})
    specials = list(spec["specials"]) + ([spec["unk"]] if spec["unk"] and spec["unk"] not in spec["specials"]
                                         else [])
    return CharTokenizer(spec, Vocab.from_counts(counts, specials=specials, unk=spec["unk"], eos=None,
                                                 bos=None))


# -- word ----------------------------------------------------------------------------------------------


class WordTokenizer:
    boundary: Boundary = "line"

    def __init__(self, spec: dict[str, Any], vocab: Vocab) -> None:
        self.spec = spec
        self.vocab = Vocab(vocab.symbols, unk=spec["unk"], eos=spec["eos"], bos=spec["bos"])
        for flag, name in (("add_eos", "eos"), ("add_bos", "bos")):
            if spec[flag] and spec[name] not in self.vocab:
                raise ValueError(f"{flag} is set but {spec[name]!r} is not in the vocabulary; the "
                                 "vocabulary and tokenizer spec do not belong together")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def symbols(self, text: str) -> Iterator[str]:
        """Words of ``text``, with ``<S>``/``<eos>`` around each line when the spec asks for them."""
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()  # the final newline ends the last line; it does not start an empty one
        bos, eos, lower = self.spec["add_bos"], self.spec["add_eos"], self.spec["lower_case"]
        for line in lines:
            if bos:
                yield self.spec["bos"]
            yield from (line.lower() if lower else line).split()
            if eos:
                yield self.spec["eos"]

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self.vocab.encode(self.symbols(text))

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        line: list[str] = []
        for s in self.vocab.decode(ids):
            if s == self.spec["eos"] and self.spec["add_eos"]:
                out.append(" ".join(line) + "\n")
                line = []
            elif not (s == self.spec["bos"] and self.spec["add_bos"] and not line):
                line.append(s)
        return "".join(out) + " ".join(line)

    def save(self, directory: str | Path) -> None:
        _save(self, directory, self.vocab)


def _fit_word(spec: dict[str, Any], train: Sequence[Source]) -> WordTokenizer:
    if spec["vocab_file"]:
        # A given vocabulary (One Billion Word's): first field of each line, in file order.
        path = Path(spec["vocab_file"])
        if not path.is_file():
            raise FileNotFoundError(f"vocabulary file {path} does not exist; pass vocab_file= or --data.data_dir "
                                    "pointing at the folder that holds it")
        symbols = [fields[0] for line in path.read_text(encoding="utf-8").split("\n")
                   if (fields := line.split())]
        return WordTokenizer(spec, Vocab(list(dict.fromkeys(symbols))))
    counts: Counter[str] = Counter()
    lower = spec["lower_case"]
    for source in train:
        for text in iter_text(source, "line"):
            for line in text.split("\n"):
                counts.update((line.lower() if lower else line).split())
    specials = list(spec["specials"])
    for flag, name in (("add_bos", "bos"), ("add_eos", "eos")):
        if spec[flag] and spec[name] not in specials:
            specials.append(spec[name])
    vocab = Vocab.from_counts(counts, specials=specials, min_freq=spec["min_freq"], max_size=spec["max_size"],
                              unk=spec["unk"], eos=spec["eos"], bos=spec["bos"])
    return WordTokenizer(spec, vocab)


# -- BPE -----------------------------------------------------------------------------------------------


def _hf_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError("BPE needs the Hugging Face 'tokenizers' package: pip install txl[cli]") from err
    return tokenizers


class BPETokenizer:
    boundary: Boundary = "line"

    def __init__(self, spec: dict[str, Any], model: Any) -> None:
        self.spec, self.model = spec, model

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_vocab_size())

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        lines = text.splitlines(keepends=True)
        if not lines:
            return np.zeros(0, dtype=np.int64)
        ids = [e.ids for e in self.model.encode_batch(lines, add_special_tokens=False)]
        return np.fromiter((i for row in ids for i in row), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self.model.decode([int(i) for i in ids]))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save(str(directory / "bpe.json"))
        _write_meta(self, directory, None)


def _new_bpe_model(tk: Any) -> Any:
    model = tk.Tokenizer(tk.models.BPE())
    model.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tk.decoders.ByteLevel()
    return model


def _fit_bpe(spec: dict[str, Any], train: Sequence[Source]) -> BPETokenizer:
    tk = _hf_tokenizers()
    model = _new_bpe_model(tk)
    trainer = tk.trainers.BpeTrainer(vocab_size=spec["vocab_size"], min_frequency=spec["min_frequency"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False, special_tokens=[])

    def lines() -> Iterator[str]:
        for source in train:
            for text in iter_text(source, "line"):
                yield from text.splitlines(keepends=True)

    model.train_from_iterator(lines(), trainer=trainer)
    return BPETokenizer(spec, model)


# -- fit, save, load -----------------------------------------------------------------------------------

_FIT = {"byte": _fit_byte, "char": _fit_char, "word": _fit_word, "bpe": _fit_bpe}


def fit_tokenizer(spec: dict[str, Any], train: Sequence[Source]) -> Tokenizer:
    """Build the tokenizer that ``spec`` describes, learning its vocabulary from the ``train`` sources."""
    spec = make_spec(spec["level"], **{k: v for k, v in spec.items() if k != "level"})
    return _FIT[spec["level"]](spec, train)  # type: ignore[return-value]


def encode_source(tokenizer: Tokenizer, source: Source) -> Iterator[np.ndarray]:
    """Ids of ``source``, chunk by chunk (never the whole file in memory)."""
    if tokenizer.boundary == "byte":
        for _, block in iter_bytes(source):
            yield tokenizer.encode(block)
    else:
        for text in iter_text(source, tokenizer.boundary):
            yield tokenizer.encode(text)


def _write_meta(tokenizer: Tokenizer, directory: Path, vocab: Vocab | None) -> None:
    meta = {"format": FORMAT, "version": 1, "spec": tokenizer.spec, "vocab_size": tokenizer.vocab_size,
            "vocab_sha256": vocab.sha256() if vocab is not None else None}
    (directory / "tokenizer.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n",
                                              encoding="utf-8")


def _save(tokenizer: Tokenizer, directory: str | Path, vocab: Vocab | None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if vocab is not None:
        vocab.save(directory / "vocab.txt")
    _write_meta(tokenizer, directory, vocab)


def load_tokenizer(directory: str | Path, *, spec: dict[str, Any] | None = None,
                   vocab_size: int | None = None) -> Tokenizer:
    """Load a tokenizer saved with ``save``; check it against an expected ``spec`` / ``vocab_size``.

    Raises ValueError when the files do not belong together (vocab.txt edited or swapped) or do not
    match what the caller expects (a model trained with another vocabulary).
    """
    directory = Path(directory)
    meta_path = directory / "tokenizer.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} does not exist; pass the directory a tokenizer was saved to")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a txl tokenizer (format {meta.get('format')!r})")
    saved = meta["spec"]
    if spec is not None:
        want = make_spec(spec["level"], **{k: v for k, v in spec.items() if k != "level"})
        if want != saved:
            diff = sorted(k for k in set(want) | set(saved) if want.get(k) != saved.get(k))
            raise ValueError(f"tokenizer in {directory} was built with a different spec (differs in {diff}: "
                             f"saved {[saved.get(k) for k in diff]}, expected {[want.get(k) for k in diff]})")
    level = saved["level"]
    tok: Tokenizer
    vocab: Vocab | None = None
    if level == "bpe":
        tok = BPETokenizer(saved, _hf_tokenizers().Tokenizer.from_file(str(directory / "bpe.json")))
    elif level == "byte" and saved["vocab"] == "fixed":
        tok = ByteTokenizer(saved)
    else:
        vocab = Vocab.load(directory / "vocab.txt", unk=None, eos=None, bos=None)
        if meta["vocab_sha256"] is not None and vocab.sha256() != meta["vocab_sha256"]:
            raise ValueError(f"{directory / 'vocab.txt'} does not match {meta_path} (vocab_sha256 differs: "
                             f"{len(vocab)} symbols now, {meta['vocab_size']} when saved); the vocabulary "
                             "was changed or replaced: restore it or re-prepare the corpus")
        tok = {"byte": ByteTokenizer, "char": CharTokenizer, "word": WordTokenizer}[level](saved, vocab)
    if tok.vocab_size != meta["vocab_size"]:
        raise ValueError(f"tokenizer in {directory} has {tok.vocab_size} symbols but tokenizer.json records "
                         f"{meta['vocab_size']}; the files do not belong together")
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise ValueError(f"tokenizer in {directory} has {tok.vocab_size} symbols but {vocab_size} were "
                         "expected (the model's vocab_size); use the tokenizer saved with that model")
    return tok
