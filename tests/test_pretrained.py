"""From a published checkpoint: loading by Hugging Face Hub repo id, and evaluating it on a corpus.

Loading by Hub repo id is tested offline: the test builds the Hub cache layout on disk
(models--ORG--NAME/{refs/main, snapshots/<hash>/...}) and reads it with HF_HUB_OFFLINE=1 and HF_HUB_CACHE
pointed at it. Nothing touches the network. Its repos hold the files Hugging Face's own ``save_pretrained``
writes (tests/golden/hf_transfo_xl_tiny, recorded from ``transformers`` 4.37.2 by
tests/golden/make_hf_transfo_xl.py): ``org/saved`` is that directory byte for byte; ``org/tiny`` has its
tokenizer files (vocab.pkl, the pickle the Hub's tokenizer map points at, and the JSON beside it) with txl
weights in pytorch_model.bin at two revisions."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

import txl
from txl.cli import main
from txl.config import RunConfig
from txl.convert.hf import config_to_hf, state_dict_to_hf
from txl.presets import load_preset

hub_constants = pytest.importorskip("huggingface_hub.constants")

WORDS = "<eos> <unk> the cat sat on a mat . dog = Valkyria".split()
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
GOLDEN = Path(__file__).resolve().parent / "golden" / "hf_transfo_xl_tiny"  # save_pretrained's files
TOKENIZER_FILES = ("vocab.pkl", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def tiny_model(seed: int) -> txl.TransformerXL:
    torch.manual_seed(seed)
    # The published wt103 checkpoint's evaluation context: mem_len 1600, clamp_len 1000, same_length.
    config = tiny_config(vocab_size=len(WORDS), mem_len=1600, clamp_len=1000, same_length=True)  # WORDS: its vocab
    return txl.TransformerXL(config).eval()


def write_hf_snapshot(folder, model) -> None:
    """A Hugging Face transfo-xl repo: config.json, pytorch_model.bin and the tokenizer files as
    ``TransfoXLTokenizer.save_pretrained`` writes them (vocab.pkl and its JSON files)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config_to_hf(model.config)))
    torch.save(state_dict_to_hf(dict(model.state_dict())), folder / "pytorch_model.bin")
    for name in TOKENIZER_FILES:
        shutil.copyfile(GOLDEN / name, folder / name)


def add_repo(cache, name: str, files) -> Path:
    """Repo org/NAME at main in the Hub cache, holding ``files`` (paths); its snapshot directory."""
    snapshot = cache / f"models--org--{name}" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, snapshot / f.name)
    (cache / f"models--org--{name}" / "refs").mkdir()
    (cache / f"models--org--{name}" / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A Hub cache with org/tiny at main (COMMIT) and at tag v0 (OTHER, other weights); offline mode."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    write_hf_snapshot(repo / "snapshots" / COMMIT, tiny_model(0))
    write_hf_snapshot(repo / "snapshots" / OTHER, tiny_model(1))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v0").write_text(OTHER)
    add_repo(cache, "saved", sorted(GOLDEN.iterdir()))  # exactly what save_pretrained wrote
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    # huggingface_hub reads these variables once, when it is imported: set what it read.
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # "org/tiny" must not exist as a local directory
    return cache


def test_repo_id_loads_from_the_cache_at_a_revision(offline_cache):
    x = torch.tensor([[2, 3, 4, 5, 6, 7, 8]])
    for revision, seed in ((None, 0), ("v0", 1), (OTHER, 1)):
        model = txl.from_pretrained("org/tiny", revision=revision)
        expected = tiny_model(seed)
        torch.testing.assert_close(model(x).log_probs, expected(x).log_probs, rtol=0, atol=1e-6)


def test_generate_cli_with_repo_id_reads_the_hub_vocabulary(offline_cache, capsys):
    assert main(["generate", "--checkpoint", "org/tiny", "--prompt", "the cat sat", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" ") and len(out.split()) >= 1  # a continuation in the vocabulary's words
    assert set(out.replace(".", " . ").split()) <= set(WORDS)


def test_missing_repo_offline_is_one_clear_line(offline_cache, capsys):
    with pytest.raises(FileNotFoundError, match=r"org/absent is not a local directory, and the Hugging Face "
                       r"Hub repo org/absent is not in the Hub cache while downloads are off \(HF_HUB_OFFLINE=1"):
        txl.from_pretrained("org/absent")
    with pytest.raises(FileNotFoundError, match="org/tiny at revision v9 is not in the Hub cache"):
        txl.from_pretrained("org/tiny", revision="v9")
    assert main(["score", "--checkpoint", "org/absent", __file__]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "org/absent is not in the Hub cache" in err


def test_missing_huggingface_hub_names_the_extra(offline_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import huggingface_hub raises ImportError
    with pytest.raises(FileNotFoundError, match=r"org/tiny is not a local directory, and reading it as a Hugging "
                       r"Face Hub repo id needs huggingface_hub: pip install 'txl\[hub\]'"):
        txl.from_pretrained("org/tiny")


def test_run_directory_loads_best_else_latest(tmp_path):
    run = tmp_path / "run"
    for name, seed in (("step_1", 0), ("step_2", 1)):
        txl.save_pretrained(tiny_model(seed), run / "checkpoints" / name)
    (run / "latest.json").write_text(json.dumps({"step": 2, "path": "checkpoints/step_2"}))
    x = torch.tensor([[2, 3, 4]])
    torch.testing.assert_close(txl.from_pretrained(run)(x).log_probs, tiny_model(1)(x).log_probs)  # latest
    (run / "best.json").write_text(json.dumps({"step": 1, "path": "checkpoints/step_1"}))
    torch.testing.assert_close(txl.from_pretrained(run)(x).log_probs, tiny_model(0)(x).log_probs)  # best


def fake_wt103(root, seed: int = 0) -> None:
    """The layout `txl data download wt103` leaves: wikitext-103/wiki.{train,valid,test}.tokens."""
    folder = root / "wikitext-103"
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    words = WORDS[1:]  # every word but <eos>, which ends each line
    for split, n_lines in (("train", 30), ("valid", 10), ("test", 40)):
        lines = [" = Valkyria = ", ""]
        for _ in range(n_lines):
            ids = torch.randint(0, len(words), (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
            lines.append(" " + " ".join(words[i] for i in ids) + " ")
        (folder / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n")


def test_eval_pretrained_repo_on_wt103_uses_its_vocabulary_and_context(offline_cache, tmp_path, capsys):
    """`txl eval --checkpoint REPO --corpus wt103 --split test` equals one long causal pass over the test
    file encoded with the checkpoint's vocabulary (mem_len 1600 >= the file: nothing is forgotten)."""
    fake_wt103(tmp_path / "wt103")
    assert main(["eval", "--checkpoint", "org/tiny", "--corpus", "wt103", "--data-dir", str(tmp_path / "wt103"),
                 "--split", "test", "--eval.batch_size", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    text = (tmp_path / "wt103" / "wikitext-103" / "wiki.test.tokens").read_text()
    ids = torch.tensor([[WORDS.index(w) for line in text.splitlines() for w in [*line.split(), "<eos>"]]])
    n_unk = int((ids == WORDS.index("<unk>")).sum())  # WikiText's own <unk> tokens: every other word is known
    assert f"wt103 test: {ids.shape[1]:,} tokens with the checkpoint's vocabulary (12 symbols, {n_unk} <unk>)" in out[0]
    assert out[0].endswith("tgt_len 128, mem_len 1600, clamp_len 1000, same_length")
    model = tiny_model(0)
    with torch.no_grad():
        nll = model(ids[:, :-1], labels=ids[:, 1:]).nll.double().mean()
    loss = float(nll)
    assert out[1].startswith(f"test: loss {loss:.4f}, ppl {math.exp(loss):.4f}, {ids.shape[1] - 1:,} tokens")


def test_eval_model_directory_needs_a_corpus(offline_cache, capsys):
    assert main(["eval", "--checkpoint", "org/tiny"]) == 2
    assert "is a model without a training run: name the corpus to evaluate on with --corpus" in \
        capsys.readouterr().err


# -- fine-tuning ------------------------------------------------------------------------------------------

FINETUNE = ["--preset", "tiny", "--max-steps", "12", "--minutes", "0", "--model.dropout", "0",
            "--model.mem_len", "8", "--model.same_length", "false", "--train.tgt_len", "8", "--train.batch_size", "4",
            "--train.log_interval", "1", "--train.progress", "false", "--train.tensorboard", "false",
            "--train.plot", "false", "--train.eval_interval", "0", "--train.ckpt_interval", "0",
            "--train.sample_tokens", "0", "--eval.batch_size", "2", "--eval.mem_len", "8", "--optim.lr", "3e-2",
            "--optim.warmup_steps", "0", "--optim.schedule", "constant"]


def new_corpus(folder) -> str:
    """A folder corpus in the checkpoint's words, with a pattern the model can learn quickly."""
    folder.mkdir()
    line = " the cat sat on a mat . \n"
    for split, n in (("train", 60), ("valid", 8), ("test", 8)):
        (folder / f"{split}.txt").write_text(line * n)
    return str(folder)


def test_finetune_from_a_hub_checkpoint_starts_at_its_loss_and_lowers_it(offline_cache, tmp_path, monkeypatch):
    import numpy as np

    from txl.data import OrderedIterator
    from txl.evaluate import evaluate
    from txl.finetune import encode_corpus, load_init, run_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    corpus_dir = new_corpus(tmp_path / "mine")
    out = tmp_path / "run"
    args = [*FINETUNE, "--data.corpus", corpus_dir, "--out", str(out)]
    assert main(["train", "--init-from", "org/tiny", *args]) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    train_loss = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}

    # The same run's corpus and first batch, by the library: the checkpoint's vocabulary, not a new one.
    init = load_init("org/tiny")
    cfg = RunConfig.from_dict(json.loads((out / "run.json").read_text()))  # what the run used
    assert cfg.model == run_config(load_preset("tiny"), {"model.mem_len": 8, "model.same_length": False,
                                                         "model.dropout": 0}, init).model
    corpus = encode_corpus(cfg, init.tokenizer)
    line_ids = [WORDS.index(w) for w in "the cat sat on a mat . <eos>".split()]
    assert corpus.train[:8].tolist() == line_ids and corpus.vocab_size == len(WORDS)
    batch = next(iter(OrderedIterator(corpus.train, batch_size=4, tgt_len=8, ext_len=0, var_len=cfg.train.var_len,
                                      seed=cfg.train.seed, rank=0, world_size=1)))
    pretrained = tiny_model(0)
    model = txl.TransformerXL(pretrained.config.replace(mem_len=8, same_length=False)).eval()  # the run's context
    model.load_state_dict(pretrained.state_dict())
    with torch.no_grad():
        first = float(model(batch.input_ids, labels=batch.labels).loss)
    assert train_loss[1] == pytest.approx(first, abs=1e-5)  # step 1 is the pretrained model's loss

    before = evaluate(model, corpus.valid, metric="ppl", batch_size=2, tgt_len=8,
                      context=model.config.context(mem_len=8))
    tuned = txl.from_pretrained(out)
    after = evaluate(tuned, corpus.valid, metric="ppl", batch_size=2, tgt_len=8,
                     context=tuned.config.context(mem_len=8))
    assert after.loss < before.loss - 0.5  # fine-tuning learnt the new corpus
    assert np.isclose(train_loss[12], min(train_loss.values()), atol=0.5)
    # The fine-tuned checkpoint keeps the pretrained architecture and vocabulary.
    assert tuned.config.replace(mem_len=1600, same_length=True) == tiny_model(0).config
    from txl.data.tokenizer import load_model_tokenizer

    saved = load_model_tokenizer(out / "checkpoints" / "step_00000012")
    assert saved.vocab.symbols == WORDS and saved.spec == init.tokenizer.spec


@pytest.mark.parametrize("extra,match", [
    (["--model.d_model", "48"], r"--model.d_model 48 changes the architecture of the checkpoint \(model.d_model = "
                                r"32\)"),
    (["--model.pre_ln", "true"], "--model.pre_ln True changes the architecture"),
    (["--data.level", "char"], "--data.level char differs from the checkpoint's tokenizer"),
    (["--data.corpus", "enwik8"], "corpus 'enwik8' is byte level but the checkpoint's tokenizer is word level"),
    (["--resume", "x"], "give one of them"),
])
def test_finetune_refuses_what_would_break_the_checkpoint(offline_cache, tmp_path, capsys, extra, match):
    corpus_dir = new_corpus(tmp_path / "mine")
    assert main(["train", "--init-from", "org/tiny", *FINETUNE, "--data.corpus", corpus_dir, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err


# -- the Hub repo as Hugging Face writes it ----------------------------------------------------------

def test_hub_repo_as_save_pretrained_writes_it_works_with_every_command(offline_cache, tmp_path, capsys,
                                                                       monkeypatch):
    """org/saved holds only what transformers' save_pretrained wrote: its vocabulary is vocab.pkl, read by the
    restricted unpickler by default, by the library and by every command that takes a checkpoint."""
    from txl.data.tokenizer import load_model_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert load_model_tokenizer("org/saved").vocab.symbols == WORDS
    model = txl.from_pretrained("org/saved")
    assert model.config.vocab_size == len(WORDS) and model.config.mem_len == 1600
    assert main(["generate", "--checkpoint", "org/saved", "--prompt", "the cat", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    assert set(capsys.readouterr().out.replace(".", " . ").split()) <= set(WORDS)
    fake_wt103(tmp_path / "wt103")
    assert main(["eval", "--checkpoint", "org/saved", "--corpus", "wt103", "--data-dir", str(tmp_path / "wt103"),
                 "--eval.batch_size", "1", "--max-batches", "1", "--no-progress"]) == 0
    assert "with the checkpoint's vocabulary (12 symbols" in capsys.readouterr().out
    assert main(["score", "--checkpoint", "org/saved", "--pretokenized", str(tmp_path / "wt103" / "wikitext-103" /
                 "wiki.valid.tokens")]) == 0
    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["train", "--init-from", "org/saved", *FINETUNE, "--max-steps", "2", "--data.corpus",
                 new_corpus(tmp_path / "mine"), "--out", str(out)]) == 0
    assert load_model_tokenizer(out).vocab.symbols == WORDS  # a run directory, as every command takes


def test_hub_fetch_patterns_cover_what_save_pretrained_writes():
    """Online, hub_snapshot fetches by pattern: the vocabulary and config files of a real save are among them."""
    from fnmatch import fnmatch

    from txl.pretrained import _HUB_SMALL_FILES

    fetched = {f.name for f in GOLDEN.iterdir() if any(fnmatch(f.name, p) for p in _HUB_SMALL_FILES)}
    assert fetched == {f.name for f in GOLDEN.iterdir()} - {"model.safetensors"}  # weights: one at a time


def hostile_pickle(path) -> None:
    import os
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    path.write_bytes(pickle.dumps({"idx2sym": Exploit()}))


@pytest.mark.parametrize("command", [
    ["generate", "--checkpoint", "org/evil", "--prompt", "the cat"],
    ["score", "--checkpoint", "org/evil", "{text}"],
    ["eval", "--checkpoint", "org/evil", "--corpus", "{corpus}"],
    ["train", "--init-from", "org/evil", *FINETUNE, "--data.corpus", "{corpus}"],
    ["generate", "--checkpoint", "org/saved", "--vocab", "{evil}", "--prompt", "the cat"],
    ["eval", "--checkpoint", "org/saved", "--corpus", "{corpus}", "--vocab", "{evil}"],
    ["train", "--init-from", "org/saved", *FINETUNE, "--data.corpus", "{corpus}", "--vocab", "{evil}"],
], ids=["generate", "score", "eval", "train-init-from", "generate-vocab", "eval-vocab", "train-vocab"])
def test_hostile_vocab_pickle_is_refused_in_one_line(offline_cache, tmp_path, capsys, command):
    snapshot = add_repo(offline_cache, "evil", [GOLDEN / n for n in ("config.json", "model.safetensors")])
    hostile_pickle(snapshot / "vocab.pkl")
    hostile_pickle(tmp_path / "evil.pkl")
    corpus = new_corpus(tmp_path / "mine")
    args = [a.format(text=f"{corpus}/test.txt", corpus=corpus, evil=tmp_path / "evil.pkl") for a in command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.endswith("vocab.pkl: refusing or unable to read the pickle: global posix.system is not allowed in "
                        "a vocabulary pickle") or err.endswith("evil.pkl: refusing or unable to read the pickle: "
                                                                 "global posix.system is not allowed in a vocabulary "
                                                                 "pickle"), err
    assert not (tmp_path / "pwned").exists()


@pytest.mark.oracle
@pytest.mark.slow
def test_recorded_hub_repo_is_what_the_oracle_writes(tmp_path):
    """tests/golden/hf_transfo_xl_tiny regenerated by transformers 4.37.2 is byte for byte the checked-in one,
    and txl's model of it equals TransfoXLLMHeadModel's."""
    transformers = pytest.importorskip("transformers")
    maker = GOLDEN.parent / "make_hf_transfo_xl.py"
    result = subprocess.run([sys.executable, str(maker), str(tmp_path / "repo")], capture_output=True, text=True,
                            timeout=300, env={**__import__("os").environ, "PYTHONHASHSEED": "0"})
    assert result.returncode == 0, result.stderr
    for f in GOLDEN.iterdir():
        assert (tmp_path / "repo" / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == sorted(p.name for p in GOLDEN.iterdir())
    hf = transformers.TransfoXLLMHeadModel.from_pretrained(GOLDEN).eval()
    x = torch.tensor([[2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        expected = hf(x).prediction_scores  # log-probabilities (B, T, V), after Hugging Face's zero memory
        ours = txl.from_pretrained(GOLDEN)
        got = ours(x, memory=ours.init_memory(1, ours.config.mem_len)).log_probs
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_finetune_evaluates_in_its_own_context_not_the_presets(offline_cache):
    """The default preset's eval.mem_len (192) is 3x its own model's training memory: a fine-tune of another model
    trained with mem_len 150 tests with 150 (its own context), unless --eval.* is given."""
    from txl.finetune import load_init, run_config

    init = load_init("org/tiny")
    preset = load_preset("default")
    assert preset["eval"]["mem_len"] == 192
    cfg = run_config(preset, {"model.mem_len": 150, "model.same_length": False}, init)
    context = cfg.eval.context(cfg.model)
    assert (context.mem_len, context.same_length) == (150, False)
    assert cfg.eval.tgt_len == preset["eval"]["tgt_len"]  # the preset's other evaluation settings stay
    given = run_config(preset, {"model.mem_len": 150, "eval.mem_len": 450}, init)
    assert given.eval.context(given.model).mem_len == 450
