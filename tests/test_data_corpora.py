"""Corpora: the paper's splits and preprocessing on tiny fixtures, PTB from shared data, the cache,
and clear errors on bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from txl.cli import main as cli_main
from txl.data.corpora import REGISTRY, files_corpus, load_corpus, text_corpus

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/data")


def test_registry_records_paper_splits_and_downloads():
    assert REGISTRY["enwik8"].split_sizes == (90_000_000, 5_000_000, 5_000_000)
    assert REGISTRY["text8"].split_sizes == (90_000_000, 5_000_000, 5_000_000)
    assert {s.metric for s in REGISTRY.values()} == {"ppl", "bpc"}
    assert REGISTRY["enwik8"].metric == REGISTRY["pennchar"].metric == "bpc"
    for spec in REGISTRY.values():
        assert (spec.downloads or spec.generated) and all(d.url.startswith("http") for d in spec.downloads)
        assert all(d.sha256 is None or len(d.sha256) == 64 for d in spec.downloads)


def test_enwik8_split_drops_newlines_and_orders_bytes_by_frequency(tmp_path):
    rng = np.random.default_rng(0)
    alphabet = np.array([10, 32, 65, 66, 200, 255], dtype=np.uint8)
    data = bytes(rng.choice(alphabet, size=120, p=[0.1, 0.3, 0.3, 0.1, 0.1, 0.1]))
    (tmp_path / "enwik8").write_bytes(data)
    spec = REGISTRY["enwik8"].replace(split_sizes=(90, 15, 15))
    c = load_corpus(spec, tmp_path, cache_dir=tmp_path / "cache")
    tok = c.tokenizer
    for split, chunk in (("train", data[:90]), ("valid", data[90:105]), ("test", data[105:120])):
        assert tok.decode_bytes(c.split(split)) == chunk.replace(b"\n", b"")
    train = np.frombuffer(data[:90], dtype=np.uint8)
    counts = {b: int((train == b).sum()) for b in set(train.tolist()) if b != 10}
    expected = sorted(counts, key=lambda b: (-counts[b], str(b)))
    assert tok.vocab.symbols == [str(b) for b in expected]  # byte 10 is not a symbol
    assert c.metric == "bpc" and c.train.dtype == np.uint8


def test_text8_character_split(tmp_path):
    text = ("anarchism originated as a term of abuse " * 4)[:150]
    (tmp_path / "text8").write_text(text)
    c = load_corpus(REGISTRY["text8"].replace(split_sizes=(120, 15, 15)), tmp_path, cache_dir=tmp_path / "c")
    assert [c.tokenizer.decode(c.split(s)) for s in ("train", "valid", "test")] == [
        text[:120], text[120:135], text[135:150]]
    assert c.tokenizer.vocab.symbols[0] == " "  # the most frequent character first


def test_split_sizes_larger_than_file_is_an_error(tmp_path):
    (tmp_path / "text8").write_text("abc")
    with pytest.raises(ValueError, match="truncated"):
        load_corpus("text8", tmp_path, cache_dir=tmp_path / "c")


def test_wikitext_words_with_eos_per_line_vocab_from_train(tmp_path):
    d = tmp_path / "wikitext-2"
    d.mkdir()
    (d / "wiki.train.tokens").write_text(" = Title = \n\n the cat <unk> the the \n")
    (d / "wiki.valid.tokens").write_text(" the dog \n")
    (d / "wiki.test.tokens").write_text(" cat \n")
    c = load_corpus("wt2", tmp_path, cache_dir=tmp_path / "c")
    v = c.tokenizer.vocab
    assert v.symbols[0] == "<eos>" and v.symbols[1] == "the"
    assert v.decode(c.train) == ["=", "Title", "=", "<eos>", "<eos>", "the", "cat", "<unk>", "the", "the",
                                "<eos>"]
    assert v.decode(c.valid) == ["the", "<unk>", "<eos>"]  # unseen word -> the files' own <unk>
    assert c.metric == "ppl"


def test_lm1b_sentences_with_standard_vocabulary(tmp_path):
    root = tmp_path / "1-billion-word-language-modeling-benchmark-r13output"
    (root / "training-monolingual.tokenized.shuffled").mkdir(parents=True)
    (root / "heldout-monolingual.tokenized.shuffled").mkdir(parents=True)
    (root / "training-monolingual.tokenized.shuffled" / "news.en-00001-of-00100").write_text("the cat sat\n")
    (root / "training-monolingual.tokenized.shuffled" / "news.en-00002-of-00100").write_text("cat\n")
    heldout = root / "heldout-monolingual.tokenized.shuffled" / "news.en.heldout-00000-of-00050"
    heldout.write_text("the dog\n")
    (tmp_path / "1b_word_vocab.txt").write_text("</S>\n<S>\n<UNK>\nthe\ncat\n")
    c = load_corpus("lm1b", tmp_path, cache_dir=tmp_path / "c")
    v = c.tokenizer.vocab
    assert v.decode(c.train) == ["<S>", "the", "cat", "<UNK>", "</S>", "<S>", "cat", "</S>"]
    assert c.valid.tolist() == [1, 3, 2, 0] and c.vocab_size == 5


def test_user_text_file_split_by_fraction_at_line_boundaries(tmp_path):
    path = tmp_path / "my.txt"
    path.write_text("".join(f"line {i % 7}\n" for i in range(100)))
    c = load_corpus(path, level="word", cache_dir=tmp_path / "c")
    decoded = [c.tokenizer.decode(c.split(s)) for s in ("train", "valid", "test")]
    assert "".join(decoded) == path.read_text()  # nothing lost, every split whole lines
    assert all(d.endswith("\n") for d in decoded) and decoded[0].count("\n") in range(85, 95)
    b = load_corpus(path, level="byte", cache_dir=tmp_path / "c")
    assert b.tokenizer.decode(np.concatenate([b.train, b.valid, b.test])) == path.read_text()


def test_user_directory_and_level_override(tmp_path):
    for s in ("train", "valid", "test"):
        (tmp_path / f"{s}.txt").write_text(f"{s} words here\n")
    c = load_corpus(tmp_path, cache_dir=tmp_path / "c")
    assert c.spec.level == "word" and c.tokenizer.vocab.unk_id is not None
    assert c.tokenizer.vocab.decode(c.test) == ["<unk>", "words", "here", "<eos>"]
    ch = load_corpus(tmp_path, level="char", cache_dir=tmp_path / "c")
    assert ch.metric == "bpc"
    assert ch.tokenizer.decode(ch.valid) == "<unk>a<unk>id words here\n"  # v and l unseen in train


def test_cache_hit_then_invalidated_by_file_change_and_tokenisation(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 10)
    first = load_corpus(path, cache_dir=tmp_path / "c")
    second = load_corpus(path, cache_dir=tmp_path / "c")
    assert not first.cached and second.cached and second.path == first.path
    assert isinstance(second.train, np.memmap)
    np.testing.assert_array_equal(first.train, second.train)
    path.write_text("Xbcdefghij" + "abcdefghij" * 9)
    changed = load_corpus(path, cache_dir=tmp_path / "c")
    assert not changed.cached and changed.path != first.path
    assert changed.tokenizer.decode(changed.train).startswith("Xbc")  # same size, new content
    other_level = load_corpus(path, level="byte", cache_dir=tmp_path / "c")
    assert not other_level.cached and other_level.path not in (first.path, changed.path)
    assert not list((tmp_path / "c").glob(".*"))  # no temporary entries left behind


def test_missing_files_name_the_path_and_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ptb\.train\.txt.*txl data download ptb"):
        load_corpus("ptb", tmp_path / "nothing", cache_dir=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "no_such.txt", cache_dir=tmp_path / "c")


def test_unknown_corpus_lists_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown corpus 'enwik9'.*enwik8.*wt103"):
        load_corpus("enwik9", cache_dir=tmp_path / "c")


def test_empty_corpus_is_an_error(tmp_path):
    for s, text in (("train", "a b\n"), ("valid", ""), ("test", "a\n")):
        (tmp_path / f"{s}.txt").write_text(text)
    with pytest.raises(ValueError, match="valid split .* is empty"):
        load_corpus(files_corpus(*(tmp_path / f"{s}.txt" for s in ("train", "valid", "test"))),
                    cache_dir=tmp_path / "c")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(text_corpus(tmp_path / "empty.txt"), cache_dir=tmp_path / "c")
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("level", ["char", "word"])
def test_non_utf8_text_names_file_and_offset(tmp_path, level):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"hello world\ncaf\xe9 au lait\n" * 3)
    with pytest.raises(ValueError, match=r"latin1\.txt.*byte offset 15.*level='byte'"):
        load_corpus(path, level=level, cache_dir=tmp_path / "c")
    assert load_corpus(path, level="byte", cache_dir=tmp_path / "c").vocab_size == 256


@pytest.mark.skipif(not (SHARED / "ptb").is_dir(), reason="shared PTB data (../shared/data/ptb) not present")
def test_ptb_word_counts_match_readme(tmp_path):
    c = load_corpus("ptb", SHARED / "ptb", cache_dir=tmp_path / "c")
    assert (len(c.train), len(c.valid), len(c.test)) == (929_589, 73_760, 82_430)
    assert c.vocab_size == 10_000 and c.train.dtype == np.uint16 and c.metric == "ppl"
    v = c.tokenizer.vocab
    assert v.symbols[0] == "<eos>" and v.symbols[1] == "the" and v.unk_id is not None
    assert int((c.train == v.eos_id).sum()) == 42_068  # one <eos> per line of ptb.train.txt


@pytest.mark.skipif(not (SHARED / "ptb-char").is_dir(), reason="shared PTB char data not present")
def test_pennchar_counts_match_readme(tmp_path):
    c = load_corpus("pennchar", SHARED / "ptb-char", cache_dir=tmp_path / "c")
    assert len(c.train) == 5_017_483 and c.vocab_size == 50 and c.metric == "bpc"
    assert "_" in c.tokenizer.vocab and c.tokenizer.vocab.symbols[0] == "<eos>"


def test_cli_prepare_prints_counts(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text("hello world\n" * 20)
    cache = str(tmp_path / "c")
    assert cli_main(["data", "prepare", str(path), "--data.level", "char", "--data.cache_dir", cache]) == 0
    out = capsys.readouterr().out
    assert "vocab 10," in out and "encoded" in out  # 9 characters + <unk>
    assert "train            216 tokens" in out  # 90% of 240 characters
    assert cli_main(["data", "prepare", "nonesuch", "--data.cache_dir", str(tmp_path / "c")]) == 2
    assert "known corpora" in capsys.readouterr().err
