"""Tokenizer files: the Hugging Face tokenizer.json txl writes gives txl's ids on real text; older
checkpoints whose txl metadata was itself named tokenizer.json still load; the sacremoses backend of the
WikiText-103 rules agrees with the built-in rules on WikiText-2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from txl.checkpoint import check_tokenizer
from txl.data.sources import Source
from txl.data.tokenizer import (
    WordTokenizer,
    fit_tokenizer,
    load_model_tokenizer,
    load_tokenizer,
    make_spec,
    read_meta,
    save_tokenizer,
    wt103,
)
from txl.data.tokenizer.hf_vocab import write_vocab_txt

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/data")
SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
PTB = SHARED / "ptb" / "ptb.valid.txt"
WT2 = SHARED / "wikitext-2" / "wiki.valid.tokens"
needs = pytest.mark.skipif(not (SHAKESPEARE.is_file() and PTB.is_file() and WT2.is_file()),
                           reason="shared corpora (../shared/data: tinyshakespeare, ptb, wikitext-2) not present")


def _head(path: Path, n: int) -> str:
    """The first ``n`` bytes of a corpus, cut after a line."""
    data = path.read_bytes()[:n]
    return data[:data.rfind(b"\n") + 1].decode("utf-8")


@needs
@pytest.mark.parametrize("corpus,level,options", [
    ("shakespeare", "byte", {}),
    ("shakespeare", "byte", {"vocab": "observed", "drop_newlines": True}),  # the enwik8 convention
    ("shakespeare", "char", {"unk": "<unk>"}),
    ("ptb", "word", {}),
    ("ptb", "word", {"specials": ["<unk>"], "add_bos": True, "lower_case": True}),  # the lm1b shape
    ("wt2", "word", {}),
    ("shakespeare", "bpe", {"vocab_size": 300}),
])
def test_hf_tokenizer_json_gives_txl_ids_on_real_text(tmp_path, corpus, level, options):
    tokenizers = pytest.importorskip("tokenizers")
    path = {"shakespeare": SHAKESPEARE, "ptb": PTB, "wt2": WT2}[corpus]
    train, held_out = tmp_path / "train.txt", _head(path, 120_000)[60_000:]  # held out: unseen symbols too
    # An observed byte vocabulary has no <unk> (as enwik8's): it learns from the held-out part as well.
    train.write_text(_head(path, 120_000 if options.get("vocab") == "observed" else 60_000), encoding="utf-8")
    tok = fit_tokenizer(make_spec(level, **options), [Source(train)])
    save_tokenizer(tok, tmp_path / "tok")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    for text in (held_out, held_out.rstrip("\n"), "", "a\n\nb  c\n"):
        assert level != "word" or tok.vocab.unk_id is not None  # both corpora hold <unk>: any text encodes
        ours = tok.encode(text)
        assert np.array_equal(np.array(hf.encode(text).ids, dtype=np.int64), ours), (level, text[:40])
    assert hf.get_vocab_size() == tok.vocab_size
    assert load_tokenizer(tmp_path / "tok").encode(held_out).tolist() == tok.encode(held_out).tolist()


@pytest.mark.parametrize("level,options,prefix", [
    ("byte", {}, "\n"), ("byte", {"drop_newlines": True}, None), ("char", {}, "\n"), ("char", {"unk": "<unk>"}, "\n"),
    ("word", {}, "<eos>"), ("bpe", {"vocab_size": 300}, "\n"),
])
def test_tokenizer_config_declares_the_document_prefix(tmp_path, level, options, prefix):
    """tokenizer_config.json beside tokenizer.json names as eos_token the token read before a document (what
    lm-evaluation-harness reads first): word level's <eos> (txl score's context token), else the line break,
    none where the vocabulary cannot hold one; and no bos_token, which the harness would prefer."""
    tokenizers = pytest.importorskip("tokenizers")
    train = tmp_path / "train.txt"
    train.write_text("the cat sat\non the mat\n" * 50, encoding="utf-8")
    tok = fit_tokenizer(make_spec(level, **options), [Source(train)])
    save_tokenizer(tok, tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "bos_token" not in config
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    if prefix is None:
        assert tok.prefix_id is None and config["eos_token"] is None
        return
    assert tok.prefix_id == (tok.context_id if level == "word" else int(tok.encode("\n")[0]))
    assert hf.token_to_id(config["eos_token"]) == tok.prefix_id and tok.decode([tok.prefix_id]).strip("\n") in (
        "", prefix)


def test_no_hf_tokenizer_json_for_wikitext103_rules(tmp_path):
    write_vocab_txt(["<eos>", "<unk>", "the", "cat", "'s"], tmp_path / "vocab.txt")
    tok = WordTokenizer.from_hf_vocab(tmp_path / "vocab.txt")
    assert tok.spec["rules"] == "wt103" and tok.encode_prompt("the cat's") == [2, 3, 4]
    save_tokenizer(tok, tmp_path / "tok")
    assert not (tmp_path / "tok" / "tokenizer.json").exists()  # Moses rules are not expressible in it
    again = load_tokenizer(tmp_path / "tok")
    assert again.spec == tok.spec and again.encode_prompt("the cat's") == [2, 3, 4]
    assert again.decode([2, 3, 4, 0, 2]) == "the cat's\nthe"


def _as_old_checkpoint(directory: Path) -> None:
    """Rewrite a saved tokenizer as txl wrote it before txl_tokenizer.json: its metadata in tokenizer.json
    (format 'txl-tokenizer', version 1) and a spec without the options added since (rules, wt103_backend)."""
    meta = json.loads((directory / "txl_tokenizer.json").read_text(encoding="utf-8"))
    meta["version"] = 1
    for key in ("rules", "wt103_backend"):
        meta["spec"].pop(key, None)
    (directory / "txl_tokenizer.json").unlink()
    (directory / "tokenizer.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@pytest.mark.parametrize("level", ["byte", "char", "word"])
def test_old_checkpoint_with_txl_format_tokenizer_json_still_loads(tmp_path, level):
    train = tmp_path / "train.txt"
    train.write_text("the cat sat on the mat\nthe dog\n", encoding="utf-8")
    spec = make_spec(level, **({"specials": ["<eos>", "<unk>"]} if level == "word" else {}))
    tok = fit_tokenizer(spec, [Source(train)])
    ckpt = tmp_path / "ckpt"
    save_tokenizer(tok, ckpt / "tokenizer")
    _as_old_checkpoint(ckpt / "tokenizer")
    assert read_meta(ckpt / "tokenizer")["version"] == 1
    old = load_tokenizer(ckpt / "tokenizer", spec=spec)  # the old spec's missing options take their defaults
    assert old.spec == tok.spec and old.encode("the cat\n").tolist() == tok.encode("the cat\n").tolist()
    assert load_model_tokenizer(ckpt).encode_prompt("the dog") == tok.encode_prompt("the dog")
    check_tokenizer(ckpt, tok)  # resume / eval accept the corpus's tokenizer against the old files


def test_hf_tokenizer_json_alone_is_not_taken_for_txl(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    assert read_meta(tmp_path) is None
    with pytest.raises(ValueError, match="not a txl tokenizer"):
        load_tokenizer(tmp_path)


@needs
def test_sacremoses_backend_agrees_with_builtin_rules_on_wikitext2():
    """Raw text made from WikiText-2 lines (detokenised), tokenised again by both backends: on the first
    40 article lines all agree but at most one (1,835 of 1,841 lines on the whole validation file)."""
    pytest.importorskip("sacremoses")
    moses = wt103.Moses()
    lines = [line for line in WT2.read_text(encoding="utf-8").split("\n")
             if line.strip() and not line.lstrip().startswith("=")][:40]
    raw = [wt103.detokenize(line) for line in lines]
    agree = sum(wt103.tokenize(text) == moses.tokenize(text) for text in raw)
    assert agree >= len(raw) - 1, agree
    assert sum(moses.detokenize(line) == text for line, text in zip(lines, raw)) >= len(raw) - 1


def test_sacremoses_backend_through_the_word_tokenizer(tmp_path):
    pytest.importorskip("sacremoses")
    write_vocab_txt(["<eos>", "<unk>", "It", "'s", "5", "@,@", "000", "state", "@-@", "of", "art", "."],
                    tmp_path / "vocab.txt")
    builtin = WordTokenizer.from_hf_vocab(tmp_path / "vocab.txt")
    moses = WordTokenizer.from_hf_vocab(tmp_path / "vocab.txt", wt103_backend="sacremoses")
    text = "It's 5,000 state-of-art.\nIt's"
    assert moses.encode_prompt(text) == builtin.encode_prompt(text) == [2, 3, 4, 5, 6, 7, 8, 9, 8, 10, 11, 0, 2, 3]
    assert moses.decode(moses.encode_prompt(text)) == builtin.decode(builtin.encode_prompt(text)) == text


def test_sacremoses_missing_is_one_clear_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sacremoses", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'txl\[moses\]'"):
        wt103.Moses()
