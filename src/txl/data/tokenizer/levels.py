"""The tokenizer: byte, char, word and BPE levels, each with a plain-dict spec.

One class per level, one base class for what every level does the same way: encode a prompt (words
it does not know are named in a warning), encode a document line by line, show one token, and stream
generated ids back into text (:meth:`Tokenizer.stream`). A tokenizer's ``spec`` (a JSON-able dict)
says how it was built: the level and its options, never learned state. The spec goes into the
token-cache key and is saved beside a model, so a changed tokenisation is never silently reused.
Saving and loading (and Hugging Face ``tokenizer.json`` export) are in ``txl.data.tokenizer.files``.

Levels:

* ``byte``: raw bytes. ``vocab="fixed"`` gives ids 0..255 = byte values; ``vocab="observed"`` keeps
  only the bytes seen in the training split, most frequent first (the enwik8 convention of the
  original code, whose symbols are the decimal byte values). ``drop_newlines`` drops byte 10.
* ``char``: Unicode characters of UTF-8 text; the vocabulary is the training split's characters.
* ``word``: words, with ``<eos>`` at each line end as WikiText/PTB do; words not in the vocabulary map
  to ``<unk>`` when the vocabulary has it. ``rules`` says how a line is cut into words and words are
  joined back: ``"whitespace"`` (pre-tokenised corpora) or ``"wt103"`` (raw English text to WikiText-103
  tokens and back, ``txl.data.tokenizer.wt103``; ``wt103_backend="sacremoses"`` applies the Moses reference
  instead of the built-in rules). A Hugging Face / original Transformer-XL vocabulary file is loaded by
  :meth:`WordTokenizer.from_hf_vocab`.
* ``bpe``: byte-level BPE trained with Hugging Face ``tokenizers`` (``pip install txl[cli]``).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from txl.data.sources import Boundary, Source, iter_bytes, iter_text
from txl.data.tokenizer import wt103
from txl.data.tokenizer.stream import TextStream
from txl.data.tokenizer.vocab import BOS, EOS, UNK, Vocab

logger = logging.getLogger(__name__)

Level = Literal["byte", "char", "word", "bpe"]
LEVELS: tuple[str, ...] = ("byte", "char", "word", "bpe")
RULES: tuple[str, ...] = ("whitespace", "wt103")
WT103_BACKENDS: tuple[str, ...] = ("builtin", "sacremoses")

_DEFAULTS: dict[str, dict[str, Any]] = {
    "byte": {"vocab": "fixed", "drop_newlines": False},
    "char": {"specials": [], "unk": None},
    "word": {"specials": [EOS], "unk": UNK, "eos": EOS, "bos": BOS, "add_eos": True, "add_bos": False,
             "lower_case": False, "min_freq": 1, "max_size": None, "vocab_file": None, "rules": "whitespace",
             "wt103_backend": "builtin"},
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
    if level == "word" and spec["rules"] not in RULES:
        raise ValueError(f"word rules must be one of {', '.join(RULES)}, got {spec['rules']!r}")
    if level == "word" and spec["wt103_backend"] not in WT103_BACKENDS:
        raise ValueError(f"wt103_backend must be one of {', '.join(WT103_BACKENDS)}, got {spec['wt103_backend']!r}")
    return spec


def complete_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with the defaults of its level filled in (a spec saved before an option existed)."""
    return make_spec(spec["level"], **{k: v for k, v in spec.items() if k != "level"})


class Tokenizer:
    """What every level does: text <-> ids, prompts, documents, one token's text, streaming."""

    spec: dict[str, Any]
    boundary: Boundary
    """How text may be cut into chunks without changing the encoding."""

    @property
    def level(self) -> str:
        return str(self.spec["level"])

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str | bytes) -> np.ndarray:
        """Ids of a document (int64); word level ends every line, the last included, with ``<eos>``."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt to continue (word level: no ``<eos>`` after its last words, so the line goes on)."""
        return [int(i) for i in self.encode(text)]

    def encode_lines(self, lines: Iterable[str], *, final_eos: bool = False) -> Iterator[int]:
        """Ids of a document given as lines (each ending in '\\n' but perhaps the last), one line at a time: the
        text's tokens and nothing more (word level: a line break is ``<eos>``, and a last line without one gets
        none, as a prompt's; see ``context_id`` for the document rule). ``final_eos``: word level ends that last
        line with ``<eos>`` too, as ``encode`` reads a corpus file for training (other levels add nothing)."""
        for line in lines:
            yield from (int(i) for i in self.encode(line))

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (the ``token`` field of scores)."""
        return self.decode([int(token_id)])

    @property
    def context_id(self) -> int | None:
        """The token read before a document so that its first token is scored too, as if the document followed a
        line: the end of a line, ``<eos>`` at word level, else the line break where the vocabulary holds it as one
        token (char, byte, BPE); None otherwise (a byte vocabulary that never saw one: the first token is then
        unscored).

        The one rule of every reader of documents (`txl score`, a `txl serve` session or completion, the lm-eval
        model in process and over HTTP, whose prefix token this is): the document is read after this token, and
        its tokens are its text's, a line break ``<eos>`` at word level and no ``<eos>`` added after a last line
        without one. So they all give the same log-likelihood for the same text."""
        try:
            ids = [int(i) for i in self.encode("\n")]
        except ValueError:  # a byte vocabulary that never saw a line break
            return None
        return ids[0] if len(ids) == 1 and ids[0] != self.unk_id else None

    @property
    def prefix_id(self) -> int | None:
        """The token a client reads before a document so that its first token is scored (lm-evaluation-harness's
        prefix token, the ``eos_token`` of the exported ``tokenizer_config.json``): ``context_id``."""
        return self.context_id

    @property
    def unk_id(self) -> int | None:
        """The id unknown symbols become, when the vocabulary has one."""
        vocab = getattr(self, "vocab", None)
        return vocab.unk_id if vocab is not None else None

    @property
    def eos_id(self) -> int | None:
        """The id of the end-of-line symbol, when the vocabulary has one."""
        vocab = getattr(self, "vocab", None)
        return vocab.eos_id if vocab is not None else None

    def stream(self) -> TextStream:
        """A :class:`TextStream` that turns generated ids into text as they come."""
        return TextStream(self)


# -- byte ----------------------------------------------------------------------------------------------


class ByteTokenizer(Tokenizer):
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

    def token_text(self, token_id: int) -> str:
        # A lone byte need not be valid UTF-8: show it escaped rather than as a replacement character.
        return self.decode_bytes([int(token_id)]).decode("utf-8", errors="backslashreplace")


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


class CharTokenizer(Tokenizer):
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

    def encode_prompt(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.vocab})
        if unknown and self.vocab.unk_id is None:
            raise ValueError(f"character(s) {unknown[:10]} are not in the vocabulary, which has no <unk>; "
                             "use only characters the model was trained with")
        if unknown:
            logger.warning("prompt character(s) not in the vocabulary became <unk>: %s", unknown[:20])
        return super().encode_prompt(text)


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


def _rules(spec: dict[str, Any]) -> tuple[Callable[[str], list[str]], Callable[[list[str]], str] | None]:
    """How a line becomes words, and words text again (None: lines of space-separated words)."""
    if spec["rules"] == "whitespace":
        return str.split, None
    if spec["wt103_backend"] == "sacremoses":
        moses = wt103.Moses()
        return moses.tokenize, functools.partial(moses.detokenize, eos=spec["eos"])
    return wt103.tokenize, functools.partial(wt103.detokenize, eos=spec["eos"])


class WordTokenizer(Tokenizer):
    boundary: Boundary = "line"

    def __init__(self, spec: dict[str, Any], vocab: Vocab) -> None:
        self.spec = spec
        self.vocab = Vocab(vocab.symbols, unk=spec["unk"], eos=spec["eos"], bos=spec["bos"])
        for flag, name in (("add_eos", "eos"), ("add_bos", "bos")):
            if spec[flag] and spec[name] not in self.vocab:
                raise ValueError(f"{flag} is set but {spec[name]!r} is not in the vocabulary; the "
                                 "vocabulary and tokenizer spec do not belong together")
        self._split, self._join = _rules(spec)

    @classmethod
    def from_hf_vocab(cls, path: str | Path, *, allow_pickle: bool = True, rules: str = "wt103",
                      wt103_backend: str = "builtin", vocab_size: int | None = None) -> WordTokenizer:
        """The word tokenizer of a Hugging Face / original Transformer-XL vocabulary file.

        ``vocab.txt`` / ``vocab.json``, or a pickled ``vocab.pkl`` / ``vocab.bin`` read with a restricted
        unpickler (``txl.data.tokenizer.hf_vocab``; ``allow_pickle=False`` refuses pickles). Its text follows the
        WikiText-103 conventions, so ``rules="wt103"`` by default; ``rules="whitespace"`` for text already in
        WikiText form. The tokens of an ``added_tokens.json`` beside it are appended at their ids, as
        ``transformers`` reads them (those below ``vocab_size``, the model's, when given; see
        ``hf_vocab.with_added_tokens``); they are whole words, as the vocabulary's.
        """
        from txl.data.tokenizer.hf_vocab import ADDED_TOKENS_FILE, read_vocab, with_added_tokens

        vocab = read_vocab(path, allow_pickle=allow_pickle)
        if (added := Path(path).parent / ADDED_TOKENS_FILE).is_file():
            vocab = with_added_tokens(vocab, added, vocab_size=vocab_size)
        spec = make_spec("word", specials=[], unk=vocab.unk, eos=EOS, add_eos=vocab.eos_id is not None,
                         rules=rules, wt103_backend=wt103_backend)
        return cls(spec, vocab)

    def with_rules(self, rules: str) -> WordTokenizer:
        """The same vocabulary with other split/join rules (``"whitespace"`` for pre-tokenised text)."""
        return WordTokenizer(make_spec("word", **{**{k: v for k, v in self.spec.items() if k != "level"},
                                                  "rules": rules}), self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def context_id(self) -> int | None:
        return self.vocab.eos_id

    def _words(self, lines: Iterable[str], *, final_eos: bool) -> Iterator[str]:
        """Words of ``lines``, with ``<S>``/``<eos>`` around each line when the spec asks for them; a
        last line without a line break gets its ``<eos>`` only when ``final_eos``."""
        bos, eos, lower = self.spec["add_bos"], self.spec["add_eos"], self.spec["lower_case"]
        for line in lines:
            if bos:
                yield self.spec["bos"]
            yield from self._split(line.lower() if lower else line)
            if eos and (final_eos or line.endswith("\n")):
                yield self.spec["eos"]

    def symbols(self, text: str) -> Iterator[str]:
        """Words of ``text``, with ``<S>``/``<eos>`` around each line when the spec asks for them."""
        return self._words(_lines(text) or [""], final_eos=True)  # "" is one empty line, as in a file

    def _ids(self, words: Iterable[str], *, unknown: list[str] | None) -> Iterator[int]:
        index, unk = self.vocab.index, self.vocab.unk_id
        for w in words:
            i = index.get(w)
            if i is None:
                if unk is None:
                    raise ValueError(f"the word {w!r} is not in the vocabulary, which has no <unk> to stand for "
                                     "it; use only words the model was trained with, or rebuild the vocabulary "
                                     "with '<unk>' among its specials")
                if unknown is not None:
                    unknown.append(w)
                i = unk
            yield i

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self.vocab.encode(self.symbols(text))

    def encode_prompt(self, text: str) -> list[int]:
        unknown: list[str] = []
        ids = list(self._ids(self._words(_lines(text), final_eos=False), unknown=unknown))
        if unknown:
            shown = ", ".join(repr(w) for w in dict.fromkeys(unknown[:20]))
            logger.warning("%d prompt word(s) not in the vocabulary became <unk>: %s", len(unknown), shown)
        return ids

    def encode_lines(self, lines: Iterable[str], *, final_eos: bool = False) -> Iterator[int]:
        return self._ids(self._words(lines, final_eos=final_eos), unknown=None)

    def decode(self, ids: Iterable[int]) -> str:
        words = self.vocab.decode(ids)
        if self._join is not None:
            return self._join([w for w in words if not (self.spec["add_bos"] and w == self.spec["bos"])])
        out: list[str] = []
        line: list[str] = []
        for s in words:
            if s == self.spec["eos"] and self.spec["add_eos"]:
                out.append(" ".join(line) + "\n")
                line = []
            elif not (s == self.spec["bos"] and self.spec["add_bos"] and not line):
                line.append(s)
        return "".join(out) + " ".join(line)

    def token_text(self, token_id: int) -> str:
        return self.vocab.symbols[int(token_id)]


def _lines(text: str) -> list[str]:
    """Lines of ``text`` cut at '\\n' only, each keeping its '\\n' (a final one ends the last line, it
    does not start an empty one)."""
    lines = [line + "\n" for line in text.split("\n")]
    last = lines.pop()[:-1]
    if last:
        lines.append(last)
    return lines


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
    lower, split = spec["lower_case"], _rules(spec)[0]
    for source in train:
        for text in iter_text(source, "line"):
            for line in text.split("\n"):
                counts.update(split(line.lower() if lower else line))
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


class BPETokenizer(Tokenizer):
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
