"""The vocabulary: an ordered list of symbols, most frequent first.

Adaptive input and adaptive softmax (Baevski & Auli 2019; Grave et al. 2017) cut the vocabulary into
clusters by id, so id order must be frequency order. Ties are broken by the symbol itself, so the
same counts always give the same ids. Special symbols (``<eos>``, ``<unk>``, ``<S>``) are given up
front and come first, as in the original Transformer-XL ``Vocab``.

On disk a vocabulary is plain UTF-8 text, one symbol per line (never a pickle). Symbols that contain
a line break or a backslash are escaped (``\\n``, ``\\r``, ``\\\\``) so every symbol fits on one line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

UNK = "<unk>"
EOS = "<eos>"
BOS = "<S>"

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r"}
_UNESCAPES = {"\\": "\\", "n": "\n", "r": "\r"}


def _escape(symbol: str) -> str:
    return "".join(_ESCAPES.get(c, c) for c in symbol)


def _unescape(line: str, path: Path, lineno: int) -> str:
    out, i = [], 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            nxt = line[i + 1] if i + 1 < len(line) else ""
            if nxt not in _UNESCAPES:
                raise ValueError(f"{path}:{lineno}: bad escape {line[i:i + 2]!r} in vocabulary file")
            out.append(_UNESCAPES[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Vocab:
    """Symbols and their ids. ``unk``/``eos``/``bos`` name the special symbols (None: not used)."""

    def __init__(self, symbols: Sequence[str], *, unk: str | None = UNK, eos: str | None = EOS,
                 bos: str | None = BOS) -> None:
        self.symbols: list[str] = list(symbols)
        self.index: dict[str, int] = {}
        for i, s in enumerate(self.symbols):
            if s in self.index:
                raise ValueError(f"symbol {s!r} appears twice in the vocabulary (ids {self.index[s]}, {i})")
            self.index[s] = i
        # A special symbol that is not in the vocabulary is simply absent (its id is None).
        self.unk_id: int | None = self.index.get(unk) if unk is not None else None
        self.eos_id: int | None = self.index.get(eos) if eos is not None else None
        self.bos_id: int | None = self.index.get(bos) if bos is not None else None
        self.unk: str | None = unk if self.unk_id is not None else None
        """The unknown symbol, when the vocabulary has it (likewise ``eos``, ``bos``)."""
        self.eos: str | None = eos if self.eos_id is not None else None
        self.bos: str | None = bos if self.bos_id is not None else None

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], *, specials: Sequence[str] = (), min_freq: int = 1,
                    max_size: int | None = None, unk: str | None = UNK, eos: str | None = EOS,
                    bos: str | None = BOS) -> Vocab:
        """Specials first (in the given order), then symbols by count descending, ties by symbol.

        ``max_size`` bounds the total size, specials included; symbols seen fewer than ``min_freq``
        times are dropped (they will map to ``unk`` if the vocabulary has one).
        """
        symbols = list(dict.fromkeys(specials))
        ordered = sorted((s for s, c in counts.items() if c >= min_freq and s not in symbols),
                         key=lambda s: (-counts[s], s))
        if max_size is not None:
            ordered = ordered[:max(0, max_size - len(symbols))]
        return cls(symbols + ordered, unk=unk, eos=eos, bos=bos)

    def __len__(self) -> int:
        return len(self.symbols)

    def __contains__(self, symbol: str) -> bool:
        return symbol in self.index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self.symbols == other.symbols and (
            self.unk_id, self.eos_id, self.bos_id) == (other.unk_id, other.eos_id, other.bos_id)

    def __repr__(self) -> str:
        return f"Vocab({len(self)} symbols, unk_id={self.unk_id}, eos_id={self.eos_id}, bos_id={self.bos_id})"

    def id(self, symbol: str) -> int:
        """The id of ``symbol``; unknown symbols map to ``unk_id``, or raise when there is none."""
        i = self.index.get(symbol)
        if i is not None:
            return i
        if self.unk_id is None:
            raise ValueError(f"symbol {symbol!r} is not in the vocabulary, which has no unknown symbol; "
                             "rebuild the vocabulary with '<unk>' among its specials")
        return self.unk_id

    def encode(self, symbols: Iterable[str]) -> np.ndarray:
        """Ids of ``symbols`` as an int64 array."""
        index, unk = self.index, self.unk_id
        if unk is None:
            try:
                return np.fromiter((index[s] for s in symbols), dtype=np.int64)
            except KeyError as err:
                self.id(err.args[0])  # raises the explanatory error
                raise
        return np.fromiter((index.get(s, unk) for s in symbols), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Symbols of ``ids``."""
        symbols = self.symbols
        return [symbols[int(i)] for i in ids]

    # -- persistence -------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write one symbol per line, UTF-8, escaped so that each symbol is exactly one line."""
        Path(path).write_text("".join(_escape(s) + "\n" for s in self.symbols), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, *, unk: str | None = UNK, eos: str | None = EOS,
             bos: str | None = BOS) -> Vocab:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"vocabulary file {path} does not exist; pass the file written by "
                                    "Vocab.save (vocab.txt beside the tokenizer)")
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return cls([_unescape(line, path, n + 1) for n, line in enumerate(lines)], unk=unk, eos=eos, bos=bos)

    def sha256(self) -> str:
        """A digest of the symbols in order: two vocabularies with equal digests give equal ids."""
        h = hashlib.sha256()
        for s in self.symbols:
            h.update(_escape(s).encode("utf-8") + b"\n")
        return h.hexdigest()
