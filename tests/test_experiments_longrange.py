"""The long-range drivers on tiny budgets (seconds): experiments.longrange (recall accuracy against distance,
longer memory, RECL) and experiments.rotary (the rotary row beside the WikiText-2 grid). Full runs are not
tested here; experiments.recurrence runs in full in tests/test_recurrence.py."""

import functools
import json
from pathlib import Path

import numpy as np
import pytest

import experiments  # noqa: F401  (puts this checkout's src first on sys.path)
from experiments import compressive, compressive_wt2, longrange, report, rotary
from txl.data import corpora
from txl.data.recall import RecallParams, build_recall_corpus


@pytest.fixture
def small_recall(monkeypatch):
    params = RecallParams(n_keys=32, n_values=4, n_filler=8, max_distance=40, tokens=(20_000, 6_000, 1_000))
    monkeypatch.setattr(corpora, "build_recall_corpus", functools.partial(build_recall_corpus, params=params))
    return params


@pytest.mark.slow  # whole training runs (60 s loaded)
def test_longrange_writes_accuracy_by_distance_and_reuses_runs(small_recall, tmp_path, capsys):
    argv = ["--steps", "3", "--batch-size", "4", "--tgt-len", "4", "--mem-len", "4", "--n-layer", "1", "--d-model",
            "16", "--n-head", "2", "--d-inner", "32", "--eval-mems", "4,8", "--recl-contexts", "4,8,16",
            "--streams", "2", "--valid-tokens", "3000", "--threads", "1",
            "--variants", "relative-rec,relative-norec,rotary-rec",
            "--runs-dir", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    assert longrange.main(argv) == 0
    out = json.loads((tmp_path / "results" / "longrange.json").read_text())
    assert set(out["by_distance"]) == {"relative-rec", "relative-norec", "rotary-rec"}
    assert out["limits"] == {"segment": 4, "mem_plus_segment": 8, "n_layer_x_mem_len": 4, "n_layer_x_attention": 8}
    for row in out["by_distance"].values():
        assert [b["lo"] for b in row["acc"]] == list(longrange.BINS[:-1])
        assert sum(b["n"] for b in row["acc"]) == out["answers"] > 100
        assert all(0 <= b["mean"] <= 1 for b in row["acc"] if b["n"])
    assert set(out["longer_memory"]["m8"]) == {"relative-rec", "rotary-rec"}  # no memory to grow without recurrence
    assert set(out["recl"]["1.0"]) == {"relative-rec", "relative-norec", "rotary-rec"}
    assert (tmp_path / "results" / "longrange.png").stat().st_size > 10_000
    assert "| relative-rec | 1 |" in capsys.readouterr().out
    first = (tmp_path / "runs" / "relative-rec" / "scores.npz").stat().st_mtime_ns
    assert longrange.main([*argv, "--report-only"]) == 0  # finished runs and their scores are reused
    assert (tmp_path / "runs" / "relative-rec" / "scores.npz").stat().st_mtime_ns == first
    doc = tmp_path / "results.md"
    report.render(tmp_path / "results", doc)
    assert "Long-range recall" in doc.read_text()


@pytest.mark.slow  # whole training runs (16 s loaded)
def test_compressive_writes_accuracy_by_distance_with_each_models_horizons(small_recall, tmp_path, capsys):
    """experiments.compressive on a tiny budget: the compressed memory and the plain one of the same slots, their
    horizons, the table, the plot, the reading of the trained compressive model three ways; finished runs reused."""
    argv = ["--steps", "3", "--batch-size", "4", "--tgt-len", "4", "--n-layer", "1", "--d-model", "16", "--n-head",
            "2", "--d-inner", "32", "--streams", "2", "--valid-tokens", "3000", "--threads", "1",
            "--variants", "compressive-m32-c32x4,plain-m64",
            "--runs-dir", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    assert compressive.main(argv) == 0
    out = json.loads((tmp_path / "results" / "compressive.json").read_text())
    assert out["horizons"] == {"compressive-m32-c32x4": {"one_hop": 4 + 32 + 4 * 32, "n_layer_hops": 4 + 160},
                               "plain-m64": {"one_hop": 68, "n_layer_hops": 68}}
    assert out["runs"]["compressive-m32-c32x4"]["model"]["cmem_len"] == 32
    assert out["runs"]["plain-m64"]["model"]["cmem_len"] == 0
    for row in out["by_distance"].values():
        assert sum(b["n"] for b in row["acc"]) == out["answers"] > 100
    assert [r["lo"] for r in out["regions"]["plain-m64"]] == [3, 4, 36, 68, 164]
    assert set(out["diagnosis"]["compressive-m32-c32x4"]) == {"as trained", "compressed memory dropped",
                                                               "states kept uncompressed"}
    assert (tmp_path / "results" / "compressive.png").stat().st_size > 10_000
    assert "| compressive-m32-c32x4 | 64 | 1 | 164 | 164 |" in capsys.readouterr().out
    first = (tmp_path / "runs" / "plain-m64" / "scores.npz").stat().st_mtime_ns
    assert compressive.main([*argv, "--report-only"]) == 0
    assert (tmp_path / "runs" / "plain-m64" / "scores.npz").stat().st_mtime_ns == first


def test_answer_scores_are_those_of_the_answer_positions(small_recall, tmp_path):
    """The loss answer_scores reports for an answer is the model's loss for that token, read off the full pass."""
    import torch
    from conftest import tiny_config

    from txl.data import load_corpus
    from txl.model import TransformerXL

    corpus = load_corpus("recall", cache_dir=tmp_path / "tokens")
    tokens = corpus.valid[:2001]
    targets, distances = longrange.scored_targets(tokens, corpus, 2)
    assert len(targets) > 20 and (distances >= 3).all()
    torch.manual_seed(0)
    # The corpus's vocabulary; a memory longer than a stream (1000 tokens): every pass sees the whole stream.
    model = TransformerXL(tiny_config(vocab_size=corpus.vocab_size, mem_len=2000)).eval()
    nll, hit = longrange.answer_scores(model, tokens, targets, mem_len=2000, seg_len=7, n_streams=2,
                                       same_length=False)
    L = 1000
    with torch.no_grad():
        for k in (0, len(targets) - 1):
            p = int(targets[k])
            s = (p - 1) // L  # its stream; the whole stream up to p in one pass
            x = torch.as_tensor(tokens[s * L:p].astype(np.int64))[None]
            lp = model(x).log_probs[0, -1]
            assert nll[k] == pytest.approx(float(-lp[tokens[p]]), rel=1e-4)
            assert hit[k] == float(lp.argmax() == tokens[p])


def tiny_wikitext2(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and dog ran to big red house with small green tree by river".split()
    d = tmp_path / "wikitext-2"
    d.mkdir()
    for split, n in (("train", 300), ("valid", 60), ("test", 30)):
        (d / f"wiki.{split}.tokens").write_text(
            "".join(" ".join(rng.choice(words, size=rng.integers(3, 9))) + "\n" for _ in range(n)))
    return d


def test_rotary_row_beside_the_wikitext2_grid(tmp_path, monkeypatch):
    d = tiny_wikitext2(tmp_path, monkeypatch)
    argv = ["--corpus", "wt2", "--data-dir", str(d), "--steps", "2", "--tgt-len", "4", "--mem-len", "4",
            "--contexts", "4,8,12", "--cutoffs", "", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
            "--d-inner", "32", "--batch-size", "4", "--streams", "2", "--eval-seg-len", "4", "--threads", "1",
            "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    assert rotary.main(argv) == 0
    out = json.loads((tmp_path / "results" / "rotary_wt2.json").read_text())
    assert out["run"]["model"]["attn_type"] == "rotary" and out["run"]["init_len"] == 8
    assert [p["attn_len"] for p in out["long_memory"]] == [8, 12]
    with pytest.raises(SystemExit, match="rotary row is defined for wt2"):
        rotary.main(["--corpus", "ptb"])


@pytest.mark.slow  # whole training runs (23 s loaded)
def test_compressed_rows_beside_relative_rec_on_wikitext2(tmp_path, monkeypatch):
    """The compressed rows hold the plain row's 64 slots (memory 32 + 32 compressed) and are scored where their
    slots leave room for a memory, on the plain rows' positions, each compared with the plain row of its seed
    position by position; a verdict needs both seeds of both models; the report reads the file."""
    d = tiny_wikitext2(tmp_path, monkeypatch)
    argv = ["--corpus", "wt2", "--data-dir", str(d), "--steps", "2", "--tgt-len", "4", "--mem-len", "64",
            "--contexts", "4,68,100", "--cutoffs", "", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
            "--d-inner", "32", "--batch-size", "4", "--streams", "2", "--threads", "1",
            "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    assert compressive_wt2.main(argv) == 0
    out = json.loads((tmp_path / "results" / "compressive_wt2.json").read_text())
    runs = out["runs"]
    assert list(runs) == ["relative-rec", "relative-rec-seed1", "relative-rec-c32x4", "relative-rec-c32x4-seed1"]
    assert (runs["relative-rec"]["mem_len"], runs["relative-rec"]["cmem_len"]) == (64, 0)
    assert (runs["relative-rec-c32x4"]["mem_len"], runs["relative-rec-c32x4"]["cmem_len"]) == (32, 32)
    assert runs["relative-rec-c32x4"]["seed"] == 0 and runs["relative-rec-c32x4-seed1"]["seed"] == 1
    assert runs["relative-rec-c32x4"]["horizon"]["one_hop"] == 4 + 32 + 4 * 32
    assert set(runs["relative-rec"]["ppl"]) == {"4", "68", "100"}
    assert set(runs["relative-rec-c32x4"]["ppl"]) == {"68", "100"}  # 4 keys leave no room beside 32 slots
    assert runs["relative-rec"]["positions"] == runs["relative-rec-c32x4"]["positions"]
    cmp_ = out["comparisons"]
    assert {n: c["against"] for n, c in cmp_.items()} == {"relative-rec-c32x4": "relative-rec",
                                                          "relative-rec-c32x4-seed1": "relative-rec-seed1"}
    gap = cmp_["relative-rec-c32x4-seed1"]["by_length"]
    assert set(gap) == {"68", "100"}
    assert gap["68"]["gap_pct"] == pytest.approx(
        100 * (runs["relative-rec-c32x4-seed1"]["ppl"]["68"] / runs["relative-rec-seed1"]["ppl"]["68"] - 1))
    assert [n["pair"] for n in out["noise"]] == [["relative-rec", "relative-rec-seed1"],
                                                ["relative-rec-c32x4", "relative-rec-c32x4-seed1"]]
    assert set(out["verdicts"]) == {"68", "100"}
    v = out["verdicts"]["68"]
    assert v["mean_gap_pct"] == pytest.approx((cmp_["relative-rec-c32x4"]["by_length"]["68"]["gap_pct"]
                                               + gap["68"]["gap_pct"]) / 2)
    assert v["verdict"] in ("better", "worse", "within noise")
    assert [p["attn_len"] for p in out["long_memory"]["relative-rec-c32x4"]] == [68, 100]
    text = report.compressive_wt2_section({**out, "_md": str(tmp_path / "results" / "compressive_wt2.md")}, None)
    assert f"**{v['verdict']}**" in "\n".join(text) and "seed for seed" in "\n".join(text)
    with pytest.raises(SystemExit, match="compressed rows are defined for wt2"):
        compressive_wt2.main(["--corpus", "ptb"])


def test_compressive_wt2_verdicts_need_both_seeds_one_sign_beyond_2_se_and_the_seed_spread(tmp_path):
    """The verdict rule on made-up per-position losses: 'better' or 'worse' only when both seed pairs' gaps are
    beyond 2 SE with one sign and their mean exceeds the gap between two seeds of one model; 'within noise' when
    the seeds disagree or two seeds of the plain model differ by more; no verdict without all four runs."""
    from experiments import ablation

    args = ablation.parse_args(["--corpus", "wt2", "--tgt-len", "4", "--mem-len", "64", "--contexts", "4,68,100",
                                "--n-layer", "1", "--results", str(tmp_path)])
    rng = np.random.default_rng(0)
    base = 3 + 0.5 * rng.standard_normal(400)  # (P,) nats per position

    spread = rng.standard_normal(base.size)
    spread = 0.5 * (spread - spread.mean())  # (P,) mean 0: a gap of 0.02 nats over it is ~0.8 SE

    def noisy(shift: float, wide: bool) -> dict[int, np.ndarray]:
        return {c: base + shift + (spread if wide else 0) + 0.01 * rng.standard_normal(base.size) for c in (68, 100)}

    def verdicts(plain: tuple[float, float], compressed: tuple[float, float], names=compressive_wt2.ROWS,
                 wide: bool = False) -> dict:
        """``wide``: the compressed rows' per-position losses spread about the plain rows' (the same way for both
        seeds), so that a gap of the same size is within 2 SE."""
        variants = {"relative-rec": ablation.Variant("relative", True),
                    "relative-rec-seed1": ablation.Variant("relative", True, seed=1),
                    "relative-rec-c32x4": ablation.Variant("relative", True, cmem_len=32),
                    "relative-rec-c32x4-seed1": ablation.Variant("relative", True, cmem_len=32, seed=1)}
        shifts = dict(zip(compressive_wt2.ROWS, (*plain, *compressed)))
        runs = {n: {"variant": variants[n], "losses": noisy(shifts[n], wide and variants[n].cmem_len > 0),
                    "eval_wall_s": 1.0,
                    "record": {"steps": 2, "train_s": 1.0, "n_params": 10}} for n in names}
        return {c: v["verdict"] for c, v in compressive_wt2.report(runs, args, [], 1.0)["verdicts"].items()}

    assert verdicts((0, 0), (-0.1, -0.1)) == {"68": "better", "100": "better"}
    assert verdicts((0, 0), (0.1, 0.1)) == {"68": "worse", "100": "worse"}
    assert verdicts((0, 0), (-0.1, 0.1)) == {"68": "within noise", "100": "within noise"}  # the seeds disagree
    assert verdicts((0, 0.2), (-0.1, 0.1)) == {"68": "within noise", "100": "within noise"}  # plain seeds 22% apart
    assert verdicts((0, 0), (-0.02, -0.02)) == {"68": "better", "100": "better"}
    assert verdicts((0, 0), (-0.02, -0.02), wide=True) == {"68": "within noise", "100": "within noise"}  # < 2 SE
    assert verdicts((0, 0), (-0.1, -0.1), names=compressive_wt2.ROWS[:3]) == {}
