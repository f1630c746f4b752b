"""Read a Hugging Face / original Transformer-XL word vocabulary without trusting pickle.

Supported inputs (the format is detected from the file's content, not its name):

* **plain text**, the original ``vocab_file`` / ``vocab.txt`` format: one symbol per line; a line
  may carry more fields after the symbol (``symbol count``), of which only the first is used, as
  in the original ``Vocab._build_from_file`` and Hugging Face's ``TransfoXLTokenizer``. Empty lines
  are skipped; a repeated symbol keeps its first index (what both of those implementations do).
* **JSON**: a list of symbols in index order, or a ``{symbol: id}`` map whose ids are 0..n-1.
* **pickle**: the published ``vocab.pkl`` / ``vocab.bin`` of ``transfo-xl-wt103`` (``torch.save`` of
  the original ``Vocab.__dict__``, legacy or zip format) or a file written by
  ``TransfoXLTokenizer.save_vocabulary`` / ``save_pretrained`` (``pickle.dump(tokenizer.__dict__)``).

Unpickling with :mod:`pickle` runs code named by the file, so a pickle is never given to it: it is read
with a restricted unpickler that resolves only builtin containers and scalars
and ``collections.Counter`` / ``OrderedDict``. A few names that Hugging Face stores alongside the
vocabulary (its Moses tokenizer objects, compiled regular expressions, ``AddedToken``, ``Trie``) are
replaced by inert placeholders that only record their arguments: none of those modules is imported
and none of their code runs. Any other global (``os.system``, ``builtins.eval``, ...) is an error naming
it. So the published vocabulary reads by default; ``allow_pickle=False`` refuses every pickle outright.
:func:`write_vocab_txt` converts one to the plain-text file.

These readers are the Hugging Face loader of the word tokenizer (``txl.data.tokenizer.WordTokenizer.from_hf_vocab``);
they return the one :class:`~txl.data.tokenizer.vocab.Vocab` of the package.
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from txl.data.tokenizer.vocab import Vocab

__all__ = [
    "ADDED_TOKENS_FILE",
    "InertObject",
    "read_vocab",
    "restricted_unpickle",
    "vocab_from_pickled_dict",
    "with_added_tokens",
    "write_vocab_txt",
]

UNK_TOKENS = ("<unk>", "<UNK>")
EOS_TOKEN = "<eos>"

_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", name): obj
    for name, obj in {
        "dict": dict,
        "list": list,
        "tuple": tuple,
        "set": set,
        "frozenset": frozenset,
        "str": str,
        "int": int,
        "float": float,
        "bool": bool,
    }.items()
} | {
    ("collections", "Counter"): Counter,
    ("collections", "OrderedDict"): OrderedDict,
}
# Data-only objects Hugging Face pickles next to the vocabulary; read as InertObject placeholders.
_INERT_MODULE_PREFIXES = ("sacremoses",)
_INERT_GLOBALS = frozenset(
    {
        ("re", "_compile"),
        ("tokenizers", "AddedToken"),
        ("transformers.tokenization_utils", "Trie"),
        ("transformers.tokenization_utils_base", "AddedToken"),
    }
)
_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # first object of a legacy (pre-zip) torch.save file


class InertObject:
    """Placeholder for an allowed-but-untrusted global: records arguments and state, runs nothing."""

    qualified_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"InertObject({self.qualified_name})"


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if (module, name) in _INERT_GLOBALS or module.split(".")[0] in _INERT_MODULE_PREFIXES:
            return type(name, (InertObject,), {"qualified_name": f"{module}.{name}"})
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a vocabulary pickle")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("the pickle references tensor storages; a vocabulary has none")


def restricted_unpickle(data: bytes | io.BufferedIOBase) -> Any:
    """Unpickle one object, resolving only the allowed globals (see the module docstring).

    Raises ``ValueError`` naming the offending global when the pickle references anything else.
    """
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    try:
        return _RestrictedUnpickler(stream).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"refusing or unable to read the pickle: {e}") from e


def _make_vocab(symbols: Iterable[str]) -> Vocab:
    ordered = tuple(dict.fromkeys(symbols))  # keep the first occurrence of a repeated symbol
    present = set(ordered)
    unk = next((u for u in UNK_TOKENS if u in present), None)
    # Transformer-XL vocabularies have no begin-of-line symbol; <S> is an ordinary word in them.
    return Vocab(ordered, unk=unk, eos=EOS_TOKEN, bos=None)


def _parse_text(text: str) -> Vocab:
    return _make_vocab(line.split()[0] for line in text.splitlines() if line.strip())


def _parse_json(text: str, path: Path) -> Vocab:
    data = json.loads(text)
    if isinstance(data, list):
        if not all(isinstance(s, str) for s in data):
            raise ValueError(f"{path}: a JSON vocabulary list must contain only strings")
        return _make_vocab(data)
    if isinstance(data, dict):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in data.values()):
            raise ValueError(f"{path}: a JSON {{symbol: id}} vocabulary must have integer ids")
        if sorted(data.values()) != list(range(len(data))):
            raise ValueError(
                f"{path}: the ids of a JSON {{symbol: id}} vocabulary must be exactly 0..{len(data) - 1}"
            )
        return _make_vocab(sorted(data, key=data.__getitem__))
    raise ValueError(f"{path}: JSON vocabulary must be a list of symbols or a {{symbol: id}} object")


def vocab_from_pickled_dict(state: Any) -> Vocab:
    """Build a :class:`Vocab` from an unpickled ``Vocab.__dict__`` / ``TransfoXLTokenizer.__dict__``."""
    if not isinstance(state, dict) or "idx2sym" not in state:
        raise ValueError(
            "the pickle does not hold a Transformer-XL vocabulary dict (expected a dict with 'idx2sym'), "
            f"got {type(state).__name__}"
        )
    idx2sym = state["idx2sym"]
    if not isinstance(idx2sym, list) or not all(isinstance(s, str) for s in idx2sym):
        raise ValueError("'idx2sym' in the pickle must be a list of strings")
    if len(set(idx2sym)) != len(idx2sym):
        raise ValueError("'idx2sym' in the pickle contains repeated symbols")
    sym2idx = state.get("sym2idx")
    if sym2idx is not None and dict(sym2idx) != {s: i for i, s in enumerate(idx2sym)}:
        raise ValueError("'sym2idx' and 'idx2sym' in the pickle disagree")
    return _make_vocab(idx2sym)


def _load_pickle(raw: bytes) -> Any:
    if zipfile.is_zipfile(io.BytesIO(raw)):  # torch.save, zip format (torch >= 1.6)
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(names) != 1:
                raise ValueError("zip file is not a torch.save archive (no single data.pkl)")
            return restricted_unpickle(archive.read(names[0]))
    stream = io.BytesIO(raw)
    first = restricted_unpickle(stream)
    if (
        isinstance(first, int) and first == _TORCH_LEGACY_MAGIC
    ):  # legacy torch.save: magic, protocol, sys info
        restricted_unpickle(stream)
        restricted_unpickle(stream)
        return restricted_unpickle(stream)
    return first


def read_vocab(path: str | Path, *, allow_pickle: bool = True) -> Vocab:
    """Read a Transformer-XL vocabulary file (plain text, JSON, or a pickle, with the restricted unpickler).

    Returns the ordered symbols and the special tokens. A pickle that holds anything but a vocabulary
    raises ``ValueError`` naming what it refused (see the module docstring); ``allow_pickle=False``
    refuses every pickle.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:1] == b"\x80" or raw[:4] == b"PK\x03\x04":  # pickle protocol >= 2, or a torch zip archive
        if not allow_pickle:
            raise ValueError(
                f"{path} is a pickle and allow_pickle=False refuses pickles; pass allow_pickle=True (the "
                "default: a restricted unpickler that only builds plain containers), or store it as text with "
                "write_vocab_txt")
        try:
            return vocab_from_pickled_dict(_load_pickle(raw))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is neither UTF-8 text/JSON nor a pickle (protocol >= 2)") from e
    stripped = text.lstrip("\ufeff \t\r\n")
    if stripped[:1] in ("[", "{"):
        return _parse_json(stripped, path)
    return _parse_text(text)


ADDED_TOKENS_FILE = "added_tokens.json"
"""What ``save_pretrained`` writes beside the vocabulary for tokens added to it: ``{token: id}``."""


def with_added_tokens(vocab: Vocab, path: str | Path, *, vocab_size: int | None = None) -> Vocab:
    """``vocab`` with the tokens of an ``added_tokens.json`` appended at their ids, as ``transformers`` reads them.

    Hugging Face gives an added token the next id after the vocabulary (``len(tokenizer)`` grows); one already in
    the vocabulary at that id is listed but not added again. ``TransfoXLTokenizer`` adds ``<formula>`` by default
    when its vocabulary lacks it, so a model may have been sized for the base vocabulary alone: with
    ``vocab_size`` (the model's), only the added tokens whose ids are below it are appended (the others would
    index past the model's embedding; their text reads as unknown words).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); it should map each added token to its id") from None
    if not isinstance(data, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in data.values()):
        raise ValueError(f"{path} must be a JSON object mapping each added token to its integer id")
    added = []
    for token, i in sorted(data.items(), key=lambda kv: kv[1]):
        if i < len(vocab) and vocab.symbols[i] == token:
            continue  # already in the vocabulary, at that id
        added.append((token, i))
    expected = list(range(len(vocab), len(vocab) + len(added)))
    if [i for _, i in added] != expected or any(token in vocab for token, _ in added):
        raise ValueError(f"{path}: the added tokens must take the ids after the vocabulary's {len(vocab)} symbols, "
                         f"{len(vocab)}.., each once and not already in it; got {dict(added)}")
    if vocab_size is not None:
        added = [(token, i) for token, i in added if i < vocab_size]
    if not added:
        return vocab
    return Vocab(vocab.symbols + [token for token, _ in added], unk=vocab.unk, eos=vocab.eos, bos=vocab.bos)


def write_vocab_txt(symbols: Iterable[str], path: str | Path) -> Path:
    """Write ``symbols`` one per line (UTF-8) in index order; :func:`read_vocab` reads it back."""
    symbols = list(symbols)
    for i, s in enumerate(symbols):
        if not isinstance(s, str) or not s or s != "".join(s.split()):
            raise ValueError(
                f"symbol {i} ({s!r}) cannot be stored one per line: symbols must be non-empty strings "
                "without whitespace"
            )
    if len(set(symbols)) != len(symbols):
        raise ValueError("symbols contain repeats; a vocabulary file needs each symbol once")
    path = Path(path)
    path.write_text("".join(s + "\n" for s in symbols), encoding="utf-8")
    return path
