import json
import os
import pickle
import re
import sys
import types
from collections import Counter, OrderedDict

import pytest
import torch

from txl.data.tokenizer import Vocab
from txl.data.tokenizer.hf_vocab import InertObject, read_vocab, restricted_unpickle, write_vocab_txt

SYMBOLS = ["<unk>", "<eos>", "the", ",", ".", "@-@", "Valkyria"]


def original_vocab_dict() -> dict:
    """What the original Vocab.__dict__ (pickled as the published vocab.pkl) holds."""
    return {
        "counter": Counter({"the": 10, ",": 8}),
        "special": ["<eos>"],
        "min_freq": 0,
        "max_size": None,
        "lower_case": False,
        "delimiter": None,
        "vocab_file": None,
        "idx2sym": list(SYMBOLS),
        "sym2idx": OrderedDict((s, i) for i, s in enumerate(SYMBOLS)),
        "eos_idx": 1,
        "unk_idx": 0,
    }


EXPECTED = Vocab(SYMBOLS, unk="<unk>", eos="<eos>", bos=None)


def test_plain_text(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(SYMBOLS) + "\n", encoding="utf-8")
    vocab = read_vocab(path)
    assert vocab == EXPECTED
    assert vocab.index["Valkyria"] == 6 and len(vocab) == 7


def test_symbol_count_variant_and_duplicates(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("<UNK> 0\nthe 120\n, 80\n\nthe 3\n", encoding="utf-8")
    vocab = read_vocab(path)
    assert vocab.symbols == ["<UNK>", "the", ","]
    assert vocab.unk == "<UNK>" and vocab.unk_id == 0 and vocab.eos is None and vocab.eos_id is None


def test_json_list_and_map(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(SYMBOLS), encoding="utf-8")
    assert read_vocab(tmp_path / "list.json") == EXPECTED
    shuffled = {s: i for i, s in reversed(list(enumerate(SYMBOLS)))}
    (tmp_path / "map.json").write_text(json.dumps(shuffled), encoding="utf-8")
    assert read_vocab(tmp_path / "map.json") == EXPECTED


def test_json_map_with_gaps_is_rejected(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"a": 0, "b": 2}), encoding="utf-8")
    with pytest.raises(ValueError, match="exactly 0..1"):
        read_vocab(tmp_path / "bad.json")


def test_pickle_read_by_default_refused_on_request(tmp_path):
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(original_vocab_dict()))
    assert read_vocab(path) == EXPECTED  # the restricted unpickler: safe by default
    with pytest.raises(ValueError, match="allow_pickle=False refuses pickles"):
        read_vocab(path, allow_pickle=False)


@pytest.mark.parametrize("zip_format", [False, True])
def test_torch_saved_vocab_like_the_published_one(tmp_path, zip_format):
    path = tmp_path / "vocab.bin"
    torch.save(original_vocab_dict(), path, _use_new_zipfile_serialization=zip_format)
    assert read_vocab(path) == EXPECTED


class _RunsCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _CallsEval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def test_restricted_unpickler_rejects_malicious_pickles(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"idx2sym": ["a"], "x": _RunsCommand(marker)})
    path = tmp_path / "vocab.pkl"
    path.write_bytes(payload)
    with pytest.raises(ValueError, match=r"global (os|posix)\.system is not allowed"):
        read_vocab(path)
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"builtins\.eval"):
        restricted_unpickle(pickle.dumps(_CallsEval()))
    with pytest.raises(ValueError, match="not allowed"):
        restricted_unpickle(pickle.dumps(Vocab))  # even our own classes


def test_restricted_unpickler_reads_plain_containers():
    obj = {"a": [1, 2.5, "x", (True, None)], "s": {1, 2}, "c": Counter("aab")}
    assert restricted_unpickle(pickle.dumps(obj)) == obj
    inert = restricted_unpickle(pickle.dumps(re.compile("a+b")))
    assert isinstance(inert, InertObject) and inert.qualified_name == "re._compile"
    assert inert.args[0] == "a+b"


def test_pickle_with_inconsistent_indices_is_rejected(tmp_path):
    state = original_vocab_dict()
    state["sym2idx"]["the"] = 5
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(state))
    with pytest.raises(ValueError, match="disagree"):
        read_vocab(path)


def _fake_sacremoses() -> types.ModuleType:
    """A stand-in for sacremoses (not installed here) whose objects pickle under its module name."""
    module = types.ModuleType("sacremoses")

    def make(name):
        def __init__(self, lang="en"):
            self.lang = lang
            self.rules = [(re.compile(r"\s+"), " ")]

        cls = type(name, (), {"__init__": __init__, "__module__": "sacremoses"})
        setattr(module, name, cls)

    for name in ("MosesPunctNormalizer", "MosesTokenizer", "MosesDetokenizer"):
        make(name)
    return module


def hf_tokenization(monkeypatch):
    """transformers' TransfoXL tokenization module (skipped where it is not installed), with a stand-in for
    sacremoses where that is missing (only the vocabulary is exercised, never Moses tokenization)."""
    hf = pytest.importorskip("transformers.models.deprecated.transfo_xl.tokenization_transfo_xl")
    if "sacremoses" not in sys.modules:
        try:
            import sacremoses  # noqa: F401
        except ImportError:
            fake = _fake_sacremoses()
            monkeypatch.setitem(sys.modules, "sacremoses", fake)
            monkeypatch.setattr(hf, "sm", fake, raising=False)
            monkeypatch.setattr(hf, "requires_backends", lambda *args, **kwargs: None)
    return hf


@pytest.mark.oracle
def test_vocab_saved_by_hf_save_vocabulary(tmp_path, monkeypatch):
    hf = hf_tokenization(monkeypatch)
    vocab_txt = tmp_path / "vocab.txt"
    write_vocab_txt(SYMBOLS, vocab_txt)
    tokenizer = hf.TransfoXLTokenizer(vocab_file=str(vocab_txt))
    (saved,) = tokenizer.save_vocabulary(str(tmp_path))
    assert saved.endswith("vocab.pkl")

    vocab = read_vocab(saved)
    assert vocab == EXPECTED
    assert list(vocab.symbols) == tokenizer.idx2sym

    # Convert to text and read back: same vocabulary, no pickle involved.
    write_vocab_txt(vocab.symbols, tmp_path / "converted.txt")
    assert read_vocab(tmp_path / "converted.txt") == vocab


@pytest.mark.oracle
def test_added_tokens_saved_by_hf_save_pretrained(tmp_path, monkeypatch):
    """TransfoXLTokenizer.save_pretrained writes vocab.pkl and added_tokens.json (<formula>, added by default when
    the vocabulary lacks it, and a token added by add_tokens): the word tokenizer has len(tokenizer) symbols and
    gives every word transformers' id."""
    hf = hf_tokenization(monkeypatch)
    from txl.data.tokenizer import WordTokenizer

    write_vocab_txt(SYMBOLS, tmp_path / "vocab.txt")
    tokenizer = hf.TransfoXLTokenizer(vocab_file=str(tmp_path / "vocab.txt"))
    tokenizer.add_tokens(["newword"])
    out = tmp_path / "saved"
    tokenizer.save_pretrained(str(out))
    assert (out / "added_tokens.json").is_file() and (out / "vocab.pkl").is_file()
    ours = WordTokenizer.from_hf_vocab(out / "vocab.pkl", rules="whitespace")
    assert ours.vocab_size == len(tokenizer) == len(SYMBOLS) + 2
    words = list(SYMBOLS) + ["<formula>", "newword"]
    assert [ours.vocab.index[w] for w in words] == tokenizer.convert_tokens_to_ids(words)


def test_write_vocab_txt_round_trip_and_validation(tmp_path):
    path = write_vocab_txt(["<eos>", "é", "x"], tmp_path / "v.txt")
    assert path.read_text(encoding="utf-8") == "<eos>\né\nx\n"
    assert read_vocab(path) == Vocab(["<eos>", "é", "x"], unk=None, eos="<eos>", bos=None)
    with pytest.raises(ValueError, match="whitespace"):
        write_vocab_txt(["ok", "two words"], tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="whitespace"):
        write_vocab_txt(["ok", ""], tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="repeats"):
        write_vocab_txt(["a", "a"], tmp_path / "bad.txt")


def test_non_vocab_pickle_is_rejected(tmp_path):
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(["just", "a", "list"]))
    with pytest.raises(ValueError, match="idx2sym"):
        read_vocab(path)
