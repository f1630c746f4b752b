"""Vocabulary order and persistence; every tokenisation level round-trips and saves/loads."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from txl.data.sources import Source, iter_text
from txl.data.tokenizer import Vocab, fit_tokenizer, load_tokenizer, make_spec, save_tokenizer

TEXT = "the cat sat on the mat\nthe dog\n\nnaïve café ünïcödé €\n"


def test_vocab_frequency_order_with_deterministic_ties():
    counts = Counter("b a c a b a d".split())  # a:3 b:2 c:1 d:1
    v = Vocab.from_counts(counts, specials=["<eos>", "<unk>"])
    assert v.symbols == ["<eos>", "<unk>", "a", "b", "c", "d"]  # c/d tie broken by symbol
    assert (v.eos_id, v.unk_id, v.bos_id) == (0, 1, None)
    reversed_insertion = Vocab.from_counts(dict(reversed(list(counts.items()))), specials=["<eos>", "<unk>"])
    assert reversed_insertion.symbols == v.symbols
    assert Vocab.from_counts(counts, max_size=3, specials=["<eos>"]).symbols == ["<eos>", "a", "b"]
    assert Vocab.from_counts(counts, min_freq=2).symbols == ["a", "b"]


def test_vocab_encode_decode_unk_and_missing_unk():
    v = Vocab.from_counts({"x": 2, "y": 1}, specials=["<unk>"])
    ids = v.encode(["x", "zzz", "y"])
    assert ids.tolist() == [1, 0, 2] and ids.dtype == np.int64
    assert v.decode(ids) == ["x", "<unk>", "y"]
    no_unk = Vocab(["x", "y"])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        no_unk.encode(["x", "zzz"])


def test_vocab_save_load_round_trip_with_awkward_symbols(tmp_path):
    v = Vocab(["<eos>", "\n", "\\", "a\\nb", "\r", " ", "é", "<unk>"])
    v.save(tmp_path / "vocab.txt")
    text = (tmp_path / "vocab.txt").read_text(encoding="utf-8")
    assert len(text.split("\n")) == len(v) + 1  # one line per symbol
    loaded = Vocab.load(tmp_path / "vocab.txt")
    assert loaded == v and loaded.unk_id == 7 and loaded.eos_id == 0
    assert not list(tmp_path.glob("*.pkl"))


@pytest.mark.parametrize("level,options", [
    ("byte", {}), ("byte", {"vocab": "observed"}), ("char", {}), ("word", {"specials": ["<eos>", "<unk>"]}),
])
def test_levels_round_trip_and_save_load(tmp_path, level, options):
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    tok = fit_tokenizer(make_spec(level, **options), [Source(path)])
    ids = tok.encode(TEXT)
    assert ids.min() >= 0 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == TEXT
    save_tokenizer(tok, tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok", spec=make_spec(level, **options))
    assert again.spec == tok.spec and again.vocab_size == tok.vocab_size
    np.testing.assert_array_equal(again.encode(TEXT), ids)


def test_word_level_eos_per_line_and_unk(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a b\n\nb c\n", encoding="utf-8")
    tok = fit_tokenizer(make_spec("word", specials=["<eos>", "<unk>"]), [Source(path)])
    symbols = tok.vocab.decode(tok.encode("a b\n\nb c\nzzz"))
    assert symbols == ["a", "b", "<eos>", "<eos>", "b", "c", "<eos>", "<unk>", "<eos>"]
    assert tok.vocab.symbols[:2] == ["<eos>", "<unk>"] and tok.vocab.symbols[2] == "b"  # b is most frequent


def test_char_level_counts_by_frequency_and_rejects_unseen_without_unk(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("aaabbc", encoding="utf-8")
    tok = fit_tokenizer(make_spec("char"), [Source(path)])
    assert tok.vocab.symbols == ["a", "b", "c"]
    with pytest.raises(ValueError, match="not in the character vocabulary"):
        tok.encode("abz")
    with_unk = fit_tokenizer(make_spec("char", unk="<unk>"), [Source(path)])
    assert with_unk.decode(with_unk.encode("abz")) == "ab<unk>"


def test_bpe_round_trip_and_save_load(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "t.txt"
    path.write_text(TEXT * 20, encoding="utf-8")
    spec = make_spec("bpe", vocab_size=300, min_frequency=1)
    tok = fit_tokenizer(spec, [Source(path)])
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) and tok.decode(ids) == TEXT
    save_tokenizer(tok, tmp_path / "tok")
    np.testing.assert_array_equal(load_tokenizer(tmp_path / "tok", spec=spec).encode(TEXT), ids)


def test_bpe_without_tokenizers_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("no tokenizers")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    with pytest.raises(ImportError, match=r"pip install txl\[cli\]"):
        fit_tokenizer(make_spec("bpe"), [Source(path)])


def test_load_tokenizer_detects_mismatches(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    tok = fit_tokenizer(make_spec("word"), [Source(path)])
    save_tokenizer(tok, tmp_path / "tok")
    with pytest.raises(ValueError, match="different spec"):
        load_tokenizer(tmp_path / "tok", spec=make_spec("word", lower_case=True))
    with pytest.raises(ValueError, match="expected"):
        load_tokenizer(tmp_path / "tok", vocab_size=tok.vocab_size + 1)
    vocab = tmp_path / "tok" / "vocab.txt"
    vocab.write_text(vocab.read_text(encoding="utf-8") + "extra\n", encoding="utf-8")
    with pytest.raises(ValueError, match="does not match"):
        load_tokenizer(tmp_path / "tok")
    meta = json.loads((tmp_path / "tok" / "txl_tokenizer.json").read_text())
    assert meta["spec"]["level"] == "word"
    with pytest.raises(FileNotFoundError, match="txl_tokenizer.json"):
        load_tokenizer(tmp_path / "nowhere")


def test_make_spec_rejects_unknown_level_and_option():
    with pytest.raises(ValueError, match="byte, char, word, bpe"):
        make_spec("sentencepiece")
    with pytest.raises(ValueError, match="unknown option"):
        make_spec("char", lower_case=True)


def test_text_chunks_never_split_characters_or_lines(tmp_path):
    path: Path = tmp_path / "t.txt"
    data = ("ab€\ncd\n" * 50).encode("utf-8")
    path.write_bytes(data)
    chars = list(iter_text(Source(path), "char", chunk=7))
    assert "".join(chars) == data.decode() and len(chars) > 10
    lines = list(iter_text(Source(path), "line", chunk=7))
    assert "".join(lines) == data.decode() and all(c.endswith("\n") for c in lines)


def test_word_level_with_wikitext103_rules_learns_and_round_trips_raw_text(tmp_path):
    path = tmp_path / "raw.txt"
    raw = "It's a state-of-the-art model, 5,000 of them.\nDon't stop.\n"
    path.write_text(raw, encoding="utf-8")
    tok = fit_tokenizer(make_spec("word", rules="wt103", specials=["<eos>", "<unk>"]), [Source(path)])
    assert {"'s", "@-@", "@,@", "'t"} <= set(tok.vocab.symbols)  # the vocabulary is of the rules' tokens
    ids = tok.encode(raw)
    assert tok.unk_id not in ids.tolist() and tok.decode(ids) == raw
    assert tok.with_rules("whitespace").encode("It 's\n").tolist() == [tok.vocab.index["It"], tok.vocab.index["'s"], 0]
    with pytest.raises(ValueError, match="word rules must be one of whitespace, wt103"):
        make_spec("word", rules="moses")
