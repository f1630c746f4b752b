"""Tokenizer files: save and load txl's tokenizers, write Hugging Face ``tokenizer.json``, find a model's.

A saved tokenizer is a directory::

    txl_tokenizer.json  {"format": "txl-tokenizer", "spec": {...}, "vocab_size": N, "vocab_sha256": ...}
    vocab.txt           one symbol per line (byte with an observed vocabulary, char, word)
    bpe.json            the Hugging Face ``tokenizers`` model (BPE)
    tokenizer.json      a real Hugging Face ``tokenizers`` tokenizer giving the same ids, where the
                        tokenizer can be expressed in one (not the WikiText-103 rules) and the
                        ``tokenizers`` package is installed: ``tokenizers.Tokenizer.from_file`` reads it
    tokenizer_config.json  beside it: ``transformers.AutoTokenizer`` loads the directory, its ``eos_token`` the
                        token read before a document (``Tokenizer.prefix_id``, e.g. lm-evaluation-harness's prefix)

Before txl wrote ``txl_tokenizer.json`` its metadata was itself named ``tokenizer.json``, the name
Hugging Face tools read as theirs; such directories (older checkpoints) still load.

Where a model's tokenizer is found (:func:`load_model_tokenizer`):

* a txl checkpoint directory holds the tokenizer saved by training, directly or in ``tokenizer/``;
* a Hugging Face ``transfo-xl`` directory holds its word vocabulary: ``vocab.txt`` or ``vocab.json``
  (plain formats), or the pickled ``vocab.pkl`` / ``vocab.bin`` (what ``TransfoXLTokenizer.save_pretrained``
  writes), read with a restricted unpickler that builds only plain containers (``hf_vocab``), and the
  tokens of an ``added_tokens.json`` beside it appended at their ids, as ``transformers`` does.
  Its text follows the WikiText-103 conventions: prompts are tokenised with them, unless
  ``pretokenized``, and output is detokenised with them.

Word-level text ends each line with ``<eos>``. A prompt gets ``<eos>`` only after its line breaks (a
final one included), never after its last words, so the model continues the line. Words not in the
vocabulary become ``<unk>``, with a warning naming them; a vocabulary without ``<unk>`` refuses them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from txl.data.tokenizer.levels import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    WordTokenizer,
    _hf_tokenizers,
    complete_spec,
)
from txl.data.tokenizer.vocab import Vocab

logger = logging.getLogger(__name__)

FORMAT = "txl-tokenizer"
META_FILE = "txl_tokenizer.json"
HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_VOCAB_FILES = ("vocab.txt", "vocab.json")
HF_PICKLED_VOCAB_FILES = ("vocab.pkl", "vocab.bin")
UNK_FALLBACK = "<unk>"  # WordLevel needs an unknown token's name even when the vocabulary has none


# -- txl's own files ---------------------------------------------------------------------------------


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Write ``tokenizer`` into ``directory`` (see the module docstring)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab: Vocab | None = getattr(tokenizer, "vocab", None)
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.model.save(str(directory / "bpe.json"))
    elif vocab is not None:
        vocab.save(directory / "vocab.txt")
    meta = {"format": FORMAT, "version": 2, "spec": tokenizer.spec, "vocab_size": tokenizer.vocab_size,
            "vocab_sha256": vocab.sha256() if vocab is not None else None}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    try:
        hf = hf_tokenizer(tokenizer)
    except ImportError:
        hf = None
        logger.info("no %s written: the Hugging Face 'tokenizers' package is not installed", HF_FILE)
    if hf is not None:
        hf.save(str(directory / HF_FILE))
        config = hf_tokenizer_config(tokenizer, hf)
        (directory / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def hf_tokenizer_config(tokenizer: Tokenizer, hf: Any) -> dict[str, Any]:
    """``tokenizer_config.json`` beside ``tokenizer.json``: what ``transformers.AutoTokenizer`` needs to load it
    (a fast tokenizer, no model config) and the token read before a document (``Tokenizer.prefix_id``) as its
    ``eos_token``, which lm-evaluation-harness reads before every document it scores; no ``bos_token`` (the
    harness would prefer it), no padding side or chat template (the models are not chat models)."""
    prefix = tokenizer.prefix_id
    return {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "eos_token": hf.id_to_token(prefix) if prefix is not None else None}


def read_meta(directory: str | Path) -> dict[str, Any] | None:
    """The txl metadata of a tokenizer directory (``txl_tokenizer.json``, or an older txl-format
    ``tokenizer.json``); None when the directory holds no txl tokenizer."""
    directory = Path(directory)
    for name in (META_FILE, HF_FILE):
        path = directory / name
        if path.is_file():
            try:
                meta = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON ({err}); the tokenizer files are corrupt") from None
            if isinstance(meta, dict) and meta.get("format") == FORMAT:
                return meta
            if name == META_FILE:
                raise ValueError(f"{path} is not a txl tokenizer (format {meta.get('format')!r})")
    return None


def load_tokenizer(directory: str | Path, *, spec: dict[str, Any] | None = None,
                   vocab_size: int | None = None) -> Tokenizer:
    """Load a tokenizer saved with ``save``; check it against an expected ``spec`` / ``vocab_size``.

    Raises ValueError when the files do not belong together (vocab.txt edited or swapped) or do not
    match what the caller expects (a model trained with another vocabulary).
    """
    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        if (directory / HF_FILE).is_file():
            raise ValueError(f"{directory / HF_FILE} is not a txl tokenizer (no {META_FILE} beside it)")
        raise FileNotFoundError(f"{directory / META_FILE} does not exist; pass the directory a tokenizer was "
                                "saved to")
    saved = complete_spec(meta["spec"])  # a spec saved before an option existed has its default
    if spec is not None:
        want = complete_spec(spec)
        if want != saved:
            diff = sorted(k for k in set(want) | set(saved) if want.get(k) != saved.get(k))
            raise ValueError(f"tokenizer in {directory} was built with a different spec (differs in {diff}: "
                             f"saved {[saved.get(k) for k in diff]}, expected {[want.get(k) for k in diff]})")
    level = saved["level"]
    tok: Tokenizer
    if level == "bpe":
        tok = BPETokenizer(saved, _hf_tokenizers().Tokenizer.from_file(str(directory / "bpe.json")))
    elif level == "byte" and saved["vocab"] == "fixed":
        tok = ByteTokenizer(saved)
    else:
        vocab = Vocab.load(directory / "vocab.txt", unk=None, eos=None, bos=None)
        if meta["vocab_sha256"] is not None and vocab.sha256() != meta["vocab_sha256"]:
            raise ValueError(f"{directory / 'vocab.txt'} does not match the tokenizer metadata (vocab_sha256 "
                             f"differs: {len(vocab)} symbols now, {meta['vocab_size']} when saved); the vocabulary "
                             "was changed or replaced: restore it or re-prepare the corpus")
        tok = {"byte": ByteTokenizer, "char": CharTokenizer, "word": WordTokenizer}[level](saved, vocab)
    if tok.vocab_size != meta["vocab_size"]:
        raise ValueError(f"tokenizer in {directory} has {tok.vocab_size} symbols but its metadata records "
                         f"{meta['vocab_size']}; the files do not belong together")
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise ValueError(f"tokenizer in {directory} has {tok.vocab_size} symbols but {vocab_size} were "
                         "expected (the model's vocab_size); use the tokenizer saved with that model")
    return tok


# -- Hugging Face tokenizer.json ------------------------------------------------------------------------


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (``tokenizers``' ByteLevel alphabet), indexed by byte value.

    Printable Latin-1 bytes stand for themselves; the other 68 are mapped, in order, to U+0100 onwards.
    """
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, shifted = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """A ``tokenizers.Tokenizer`` that gives ``tokenizer``'s ids, or None where it cannot be expressed.

    * byte: a BPE model without merges over the byte-level alphabet, so every byte is one token;
      ``drop_newlines`` is a normaliser that removes ``\\n``;
    * char: a BPE model without merges over the characters (the whole text is one "word", so it is
      cut into characters and nothing else), unknown characters to ``<unk>`` where there is one;
    * word: the word-level model after whitespace splitting; the line ends become ``<eos>``
      (``<S>`` opening each line when ``add_bos``) by a normaliser, the last line's by the post-processor;
    * BPE: the trained model, whose input txl cuts into lines first: a ``Split`` on ``\\n`` does that.

    The WikiText-103 rules (``rules="wt103"``) are Moses' regular expressions and exceptions, which the
    ``tokenizers`` components cannot express: None.
    """
    tk = _hf_tokenizers()
    level = tokenizer.level
    spec = tokenizer.spec
    if level == "byte":
        chars = byte_chars()
        vocab_obj: Vocab | None = getattr(tokenizer, "vocab", None)
        if vocab_obj is None:
            vocab = {chars[b]: b for b in range(256)}
        else:
            vocab = {chars[int(s)] if s.isdigit() and int(s) < 256 else s: i for i, s in enumerate(vocab_obj.symbols)}
        hf = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
        if spec["drop_newlines"]:
            hf.normalizer = tk.normalizers.Replace("\n", "")
        hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = tk.decoders.ByteLevel()
        return hf
    if level == "char":
        assert isinstance(tokenizer, CharTokenizer)
        v = tokenizer.vocab
        hf = tk.Tokenizer(tk.models.BPE(vocab=dict(v.index), merges=[], unk_token=v.unk))
        hf.decoder = tk.decoders.Fuse()
        return hf
    if level == "word":
        assert isinstance(tokenizer, WordTokenizer)
        if spec["rules"] != "whitespace":
            return None
        v = tokenizer.vocab
        hf = tk.Tokenizer(tk.models.WordLevel(vocab=dict(v.index), unk_token=v.unk or UNK_FALLBACK))
        eos = spec["eos"] if spec["add_eos"] else None
        bos = spec["bos"] if spec["add_bos"] else None
        line_end = " ".join(s for s in ("", eos, bos, "") if s is not None)  # " <eos> <S> "
        normalizers = [tk.normalizers.Lowercase()] if spec["lower_case"] else []
        # txl ends every line with <eos>, the last included whether or not a '\n' ends it: drop a final
        # '\n' (\z: the end of the text), mark the others, and let the post-processor add the last <eos>.
        normalizers += [tk.normalizers.Replace(tk.Regex(r"\n\z"), ""), tk.normalizers.Replace("\n", line_end)]
        hf.normalizer = tk.normalizers.Sequence(normalizers)
        hf.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
        if eos or bos:
            template = " ".join(s for s in (bos, "$A", eos) if s is not None)
            hf.post_processor = tk.processors.TemplateProcessing(
                single=template, special_tokens=[(s, v.index[s]) for s in (bos, eos) if s is not None])
        return hf
    if level == "bpe":
        assert isinstance(tokenizer, BPETokenizer)
        hf = tk.Tokenizer.from_str(tokenizer.model.to_str())
        hf.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Split("\n", behavior="merged_with_previous"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False)])
        return hf
    return None


# -- the tokenizer of a model directory -------------------------------------------------------------------


def find_txl_tokenizer(directory: str | Path) -> Path | None:
    """The directory of the txl tokenizer saved with a checkpoint (itself or its ``tokenizer/``), or None."""
    directory = Path(directory)
    for where in (directory, directory / "tokenizer"):
        if read_meta(where) is not None:
            return where
    return None


def _holds_vocabulary(directory: Path) -> bool:
    return find_txl_tokenizer(directory) is not None or any(
        (directory / n).is_file() for n in HF_VOCAB_FILES + HF_PICKLED_VOCAB_FILES)


def load_model_tokenizer(checkpoint: str | Path, *, vocab_size: int | None = None,
                         vocab_file: str | Path | None = None, allow_pickle: bool = True,
                         pretokenized: bool = False, revision: str | None = None) -> Tokenizer:
    """The tokenizer of a model directory (see the module docstring), or of ``vocab_file`` when given.

    ``checkpoint`` is what every command takes: a checkpoint or model directory, a training run directory
    (its best checkpoint, else its latest) or a Hugging Face Hub repo id (at ``revision``).
    ``vocab_size``: the model's, checked against the vocabulary's. ``pretokenized``: word-level text is
    already split into tokens (WikiText files): split on whitespace only, and join with spaces.
    ``allow_pickle=False`` refuses a pickled vocabulary even though it is read with a restricted unpickler.
    """
    rules = "whitespace" if pretokenized else "wt103"
    tok: Tokenizer
    if vocab_file is not None:
        if not Path(vocab_file).is_file():
            raise FileNotFoundError(f"--vocab {vocab_file} is not a file: pass the vocabulary (vocab.txt, one word "
                                    "a line, JSON, or the vocab.pkl that TransfoXLTokenizer.save_pretrained writes)")
        return _checked(WordTokenizer.from_hf_vocab(vocab_file, allow_pickle=allow_pickle, rules=rules,
                                                    vocab_size=vocab_size), vocab_size)
    directory = Path(checkpoint)
    if not (directory.is_dir() and _holds_vocabulary(directory)):
        from txl.hub import resolve_model_dir

        # A run directory, a Hub repo id, or a missing path: one line each, as every command says it.
        directory = resolve_model_dir(checkpoint, revision=revision)
    if (where := find_txl_tokenizer(directory)) is not None:
        tok = load_tokenizer(where)
        if pretokenized and isinstance(tok, WordTokenizer):
            tok = tok.with_rules("whitespace")
    else:
        found = [directory / n for n in HF_VOCAB_FILES + HF_PICKLED_VOCAB_FILES if (directory / n).is_file()]
        if not found:
            raise ValueError(
                f"{directory} has no vocabulary: a txl checkpoint holds {META_FILE} (saved by training), a "
                f"Hugging Face transfo-xl directory holds {', '.join(HF_VOCAB_FILES + HF_PICKLED_VOCAB_FILES)}; "
                "add one, or pass a vocabulary file (--vocab FILE)")
        # The added tokens the model has room for: the caller's vocab_size, else the model's config beside it.
        room = vocab_size if vocab_size is not None else _config_vocab_size(directory)
        tok = WordTokenizer.from_hf_vocab(found[0], allow_pickle=allow_pickle, rules=rules, vocab_size=room)
    return _checked(tok, vocab_size)


def _config_vocab_size(directory: Path) -> int | None:
    """The vocab_size of the model config in ``directory`` (a Hugging Face config.json), or None."""
    try:
        size = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _checked(tok: Tokenizer, vocab_size: int | None) -> Tokenizer:
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise ValueError(f"the vocabulary has {tok.vocab_size} symbols but the model has vocab_size={vocab_size}; "
                         "this vocabulary does not belong to this checkpoint")
    return tok
