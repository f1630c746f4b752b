"""Loading by Hugging Face Hub repo id, offline: the test builds the Hub cache layout on disk
(models--ORG--NAME/{refs/main, snapshots/<hash>/...}) holding a tiny model as the Hub repo
transfo-xl/transfo-xl-wt103 holds it (config.json, pytorch_model.bin, vocab.json), and reads it with
HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointed at it. Nothing touches the network."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import txl
from txl.cli import main
from txl.convert.hf import config_to_hf, state_dict_to_hf

hub_constants = pytest.importorskip("huggingface_hub.constants")

WORDS = "<eos> <unk> the cat sat on a mat . dog".split()
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def tiny_model(seed: int) -> txl.TransformerXL:
    torch.manual_seed(seed)
    config = txl.ModelConfig(vocab_size=len(WORDS), n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32,
                             mem_len=8, dropout=0.0)
    return txl.TransformerXL(config).eval()


def write_hf_snapshot(folder, model) -> None:
    """The files of a Hugging Face transfo-xl repo: config.json, pytorch_model.bin, vocab.json."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config_to_hf(model.config)))
    torch.save(state_dict_to_hf(dict(model.state_dict())), folder / "pytorch_model.bin")
    (folder / "vocab.json").write_text(json.dumps(WORDS))


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
    with pytest.raises(ImportError, match=r"needs huggingface_hub: pip install 'txl\[hub\]'"):
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
