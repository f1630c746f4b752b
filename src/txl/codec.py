"""Text in, ids out, and back: the vocabulary that belongs to a checkpoint, for generation and scoring.

Where the vocabulary is found (:func:`load_codec`):

* our checkpoint directory holds the tokenizer saved by training (``tokenizer.json`` and ``vocab.txt``
  or ``bpe.json``, written by ``txl.data``), directly or in a ``tokenizer/`` subdirectory;
* a Hugging Face ``transfo-xl`` directory holds its word vocabulary: ``vocab.txt`` or ``vocab.json``
  (plain formats), or the pickled ``vocab.pkl`` / ``vocab.bin``, read only with ``allow_pickle=True``.
  Its text follows the WikiText-103 conventions (``txl.text.wt103``): prompts are tokenised with
  them, unless ``pretokenized``, and output is detokenised with them.

Word-level text ends each line with ``<eos>``. A prompt gets ``<eos>`` only after its line breaks (a
final one included), never after its last words, so the model continues the line. Words not in the
vocabulary become ``<unk>``, with a warning naming them; a vocabulary without ``<unk>`` refuses them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from txl.text import wt103

logger = logging.getLogger(__name__)

__all__ = ["Codec", "TextStream", "TokenizerCodec", "WordCodec", "load_codec"]

HF_VOCAB_FILES = ("vocab.txt", "vocab.json")
HF_PICKLED_VOCAB_FILES = ("vocab.pkl", "vocab.bin")


class Codec:
    """Encode prompts and documents, decode ids. ``level`` is 'word', 'char', 'byte' or 'bpe'."""

    level: str
    vocab_size: int
    eos_id: int | None = None

    def encode_prompt(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_lines(self, lines: Iterable[str]) -> Iterator[int]:
        """Ids of a document given as lines (each ending in '\\n' but perhaps the last), one line at a time."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (the ``token`` field of scores)."""
        return self.decode([token_id])

    @property
    def context_id(self) -> int | None:
        """The token read before a document so its first token is scored too (``<eos>``: a line ended)."""
        return self.eos_id if self.level == "word" else None


class WordCodec(Codec):
    """Word-level: one symbol per word, ``<eos>`` at line ends (WikiText, PTB, One Billion Word)."""

    level = "word"

    def __init__(self, symbols: Sequence[str], *, unk: str | None, eos: str | None, bos: str | None = None,
                 add_eos: bool = True, add_bos: bool = False, lower_case: bool = False,
                 split: Callable[[str], list[str]] = str.split,
                 join: Callable[[list[str]], str] | None = None) -> None:
        self.symbols = list(symbols)
        self.index = {s: i for i, s in enumerate(self.symbols)}
        self.vocab_size = len(self.symbols)
        self.unk_id = self.index.get(unk) if unk else None
        self.eos = eos if eos in self.index else None
        self.eos_id = self.index.get(eos) if eos else None
        self.bos = bos if add_bos and bos in self.index else None
        self.add_eos = add_eos and self.eos is not None
        self.lower_case, self.split, self.join = lower_case, split, join

    def _words(self, lines: Iterable[str], *, final_eos: bool) -> Iterator[str]:
        for line in lines:
            ended = line.endswith("\n")
            if self.bos:
                yield self.bos
            yield from self.split(line.lower() if self.lower_case else line)
            if self.add_eos and (ended or final_eos):
                yield self.eos  # type: ignore[misc]

    def _ids(self, words: Iterable[str], *, unknown: list[str] | None) -> Iterator[int]:
        for w in words:
            i = self.index.get(w)
            if i is None:
                if self.unk_id is None:
                    raise ValueError(f"the word {w!r} is not in the vocabulary, which has no <unk> to stand for "
                                     "it; use only words the model was trained with")
                if unknown is not None:
                    unknown.append(w)
                i = self.unk_id
            yield i

    def encode_prompt(self, text: str) -> list[int]:
        unknown: list[str] = []
        ids = list(self._ids(self._words(text.splitlines(keepends=True), final_eos=False), unknown=unknown))
        if unknown:
            shown = ", ".join(repr(w) for w in dict.fromkeys(unknown[:20]))
            logger.warning("%d prompt word(s) not in the vocabulary became <unk>: %s", len(unknown), shown)
        return ids

    def encode_lines(self, lines: Iterable[str]) -> Iterator[int]:
        return self._ids(self._words(lines, final_eos=True), unknown=None)

    def decode(self, ids: Sequence[int]) -> str:
        words = [self.symbols[int(i)] for i in ids if self.bos is None or self.symbols[int(i)] != self.bos]
        if self.join is not None:
            return self.join(words)
        lines, line = [], []
        for w in words:
            if w == self.eos:
                lines.append(" ".join(line))
                line = []
            else:
                line.append(w)
        return "\n".join([*lines, " ".join(line)])

    def token_text(self, token_id: int) -> str:
        return self.symbols[int(token_id)]


class TokenizerCodec(Codec):
    """A byte, char or BPE tokenizer from ``txl.data`` (its encode/decode, its vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.level = tokenizer.spec["level"]
        self.vocab_size = int(tokenizer.vocab_size)

    def encode_prompt(self, text: str) -> list[int]:
        vocab = getattr(self.tokenizer, "vocab", None)
        if self.level == "char" and vocab is not None:
            unknown = sorted({c for c in text if c not in vocab})
            if unknown and vocab.unk_id is None:
                raise ValueError(f"character(s) {unknown[:10]} are not in the vocabulary, which has no <unk>; "
                                 "use only characters the model was trained with")
            if unknown:
                logger.warning("prompt character(s) not in the vocabulary became <unk>: %s", unknown[:20])
        return [int(i) for i in self.tokenizer.encode(text)]

    def encode_lines(self, lines: Iterable[str]) -> Iterator[int]:
        for line in lines:
            yield from (int(i) for i in self.tokenizer.encode(line))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def token_text(self, token_id: int) -> str:
        if hasattr(self.tokenizer, "decode_bytes"):  # a lone byte need not be valid UTF-8
            return self.tokenizer.decode_bytes([int(token_id)]).decode("utf-8", errors="backslashreplace")
        return self.decode([token_id])


class TextStream:
    """Turns ids into text as they are generated: ``push(id)`` returns the text to show now.

    Decoding is not token-local (WikiText's ``@-@`` joins its neighbours, a byte may be half a
    character), so the output is decoded again and only text that has become stable is shown: the
    text before the last token, without a trailing replacement character of an unfinished UTF-8
    sequence. Shown text cannot be taken back: when a new token changes text already shown (rare
    detokeniser rules), decoding restarts at the token being shown, after a space for words, so the
    streamed text can differ from ``codec.decode(ids)`` in spacing there; ``decode`` stays exact.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec, self.ids = codec, []
        self.shown = ""
        self.base, self.prefix = 0, ""  # the current run decodes ids[base:], after the text prefix

    def _emit(self, end: int, *, final: bool = False) -> str:
        text = self.prefix + (self.codec.decode(self.ids[self.base:end]) if end > self.base else "")
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.shown):  # the new token changed shown text: start a new run
            self.base = end - 1
            self.prefix = self.shown + (" " if self.codec.level == "word" else "")
            return self._emit(end, final=final)
        new, self.shown = text[len(self.shown):], text
        return new

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(len(self.ids) - 1)

    def finish(self) -> str:
        return self._emit(len(self.ids), final=True)


def _hf_word_codec(vocab_path: Path, *, allow_pickle: bool, pretokenized: bool) -> WordCodec:
    from txl.text.hf_vocab import read_vocab

    vocab = read_vocab(vocab_path, allow_pickle=allow_pickle)
    if pretokenized:
        return WordCodec(vocab.symbols, unk=vocab.unk_token, eos=vocab.eos_token)
    return WordCodec(vocab.symbols, unk=vocab.unk_token, eos=vocab.eos_token, split=wt103.tokenize,
                     join=wt103.detokenize)


def _txl_tokenizer_codec(directory: Path, *, pretokenized: bool) -> Codec:
    try:
        from txl.data import load_tokenizer
    except ImportError as err:  # pragma: no cover - txl.data ships with txl
        raise ValueError(f"{directory} holds a txl tokenizer but txl.data is not available ({err})") from None
    tokenizer = load_tokenizer(directory)
    spec = tokenizer.spec
    if spec["level"] != "word":
        return TokenizerCodec(tokenizer)
    vocab = tokenizer.vocab
    return WordCodec(vocab.symbols, unk=spec.get("unk"), eos=spec.get("eos"), bos=spec.get("bos"),
                     add_eos=spec.get("add_eos", True), add_bos=spec.get("add_bos", False),
                     lower_case=spec.get("lower_case", False))


def load_codec(checkpoint: str | Path, *, vocab_size: int | None = None, vocab_file: str | Path | None = None,
               allow_pickle: bool = False, pretokenized: bool = False) -> Codec:
    """The codec of a checkpoint directory (see the module docstring), or of ``vocab_file`` when given.

    ``vocab_size``: the model's, checked against the vocabulary's. ``pretokenized``: word-level text is
    already split into tokens (WikiText files): split on whitespace only, and join with spaces.
    """
    directory = Path(checkpoint)
    if vocab_file is not None:
        codec: Codec = _hf_word_codec(Path(vocab_file), allow_pickle=allow_pickle, pretokenized=pretokenized)
    elif (directory / "tokenizer.json").is_file() or (directory / "tokenizer" / "tokenizer.json").is_file():
        where = directory if (directory / "tokenizer.json").is_file() else directory / "tokenizer"
        codec = _txl_tokenizer_codec(where, pretokenized=pretokenized)
    else:
        found = [directory / n for n in HF_VOCAB_FILES + HF_PICKLED_VOCAB_FILES if (directory / n).is_file()]
        if not found:
            raise ValueError(
                f"{directory} has no vocabulary: a txl checkpoint holds tokenizer.json (saved by training), a "
                f"Hugging Face transfo-xl directory holds {' or '.join(HF_VOCAB_FILES)}; add one, or pass a "
                "vocabulary file (--vocab FILE)")
        if found[0].name in HF_PICKLED_VOCAB_FILES and not allow_pickle:
            raise ValueError(
                f"{found[0]} is a pickled vocabulary and pickles can run code, so it is not read by default; "
                "if you trust it pass --allow-pickle (allow_pickle=True), or convert it once to vocab.txt with "
                "txl.text.hf_vocab.write_vocab_txt")
        codec = _hf_word_codec(found[0], allow_pickle=allow_pickle, pretokenized=pretokenized)
    if vocab_size is not None and codec.vocab_size != vocab_size:
        raise ValueError(f"the vocabulary has {codec.vocab_size} symbols but the model has vocab_size={vocab_size}; "
                         "this vocabulary does not belong to this checkpoint")
    return codec
