"""The experiment drivers on tiny budgets (seconds): they train, evaluate, write tables, JSON and plots,
reuse finished runs, and the report is generated from their JSON. Full runs are not tested here."""

import json
import math
import os

import numpy as np
import pytest
import torch
from conftest import tiny_config

import experiments  # noqa: F401  (puts this checkout's src first on sys.path)
import txl.train
from experiments import ablation, char, common, longmem, recl, report, speedup
from txl.model import TransformerXL

WORDS = "the cat sat on a mat and dog ran to big red house with small green tree by river".split()


def _word_text(rng, n_lines):
    return "".join(" ".join(rng.choice(WORDS, size=rng.integers(3, 9))) + "\n" for _ in range(n_lines))


@pytest.fixture
def ptb_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    d = tmp_path / "ptb"
    d.mkdir()
    for split, n in (("train", 300), ("valid", 60), ("test", 30)):
        (d / f"ptb.{split}.txt").write_text(_word_text(rng, n))
    return d


@pytest.fixture
def char_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(1)
    d = tmp_path / "ptb-char"
    d.mkdir()
    for split, n in (("train", 200), ("valid", 40), ("test", 20)):
        lines = _word_text(rng, n).splitlines()
        (d / f"ptb.char.{split}.txt").write_text("".join(" ".join(line.replace(" ", "_")) + "\n" for line in lines))
    return d


TINY_MODEL = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--d-inner", "32", "--batch-size", "4",
              "--streams", "2", "--eval-seg-len", "4", "--threads", "1"]


def ablation_args(ptb_dir, tmp_path, *more):
    return ["--data-dir", str(ptb_dir), "--steps", "2", "--tgt-len", "4", "--mem-len", "4", "--contexts", "4,8,12",
            "--cutoffs", "", "--variants", "relative-rec,al_rfou-norec", *TINY_MODEL, "--out", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results"), *more]


def test_position_losses_see_exactly_context_keys():
    """One layer, no memory effect beyond attention: the loss of position t at context c equals a fresh
    forward over the c-token window ending at t; and segment length does not matter."""
    torch.manual_seed(0)
    model = TransformerXL(tiny_config(n_layer=1, mem_len=0)).eval()  # one layer: keys are the window's tokens
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, size=41)
    c, skip = 5, 7
    got = common.position_losses(model, tokens, context=c, n_streams=1, seg_len=3, skip=skip)
    again = common.position_losses(model, tokens, context=c, n_streams=1, seg_len=8, skip=skip)
    np.testing.assert_allclose(got, again, rtol=1e-5, atol=1e-6)
    assert got.shape == (40 - skip,)
    x = torch.as_tensor(tokens[:-1])
    y = torch.as_tensor(tokens[1:])
    for t in (skip, 20, 39):
        with torch.no_grad():
            out = model(x[None, t - c + 1:t + 1], labels=y[None, t - c + 1:t + 1])
        assert got[t - skip] == pytest.approx(float(out.nll[0, -1]), rel=1e-5)
    assert model.config.mem_len == 0 and not model.config.same_length  # config restored


def test_position_losses_as_trained_see_memory_plus_segment():
    """exact=False (the ablation table): segments of seg_len with a memory of context - seg_len, as in training;
    position t then sees the keys from its segment's start - memory to t."""
    torch.manual_seed(0)
    # One layer: its memory is the embeddings of the tokens before the segment (built below).
    model = TransformerXL(tiny_config(n_layer=1, mem_len=0, attn_type="al_rfou", learned_positions=16)).eval()
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, size=41)
    c, seg, skip = 7, 3, 6
    got = common.position_losses(model, tokens, context=c, n_streams=1, seg_len=seg, skip=skip, exact=False)
    x, y = torch.as_tensor(tokens[:-1]), torch.as_tensor(tokens[1:])
    for t in (skip, 19, 20, 39):
        start = t - t % seg  # absolute positions count from the end of the keys: the whole segment is read
        with torch.no_grad():  # the memory of one layer is its input: the embeddings of the previous tokens
            out = model(x[None, start:start + seg], labels=y[None, start:start + seg],
                        memory=(model.embed(x[None, start - (c - seg):start]),))
        assert got[t - skip] == pytest.approx(float(out.nll[0, t - start]), rel=1e-5)
    with pytest.raises(ValueError, match="shorter than the segment"):
        common.position_losses(model, tokens, context=2, n_streams=1, seg_len=seg, skip=skip, exact=False)


def test_position_losses_rejects_too_few_tokens():
    model = TransformerXL(tiny_config())
    with pytest.raises(ValueError, match="skip"):
        common.position_losses(model, np.zeros(20, dtype=np.int64), context=4, n_streams=4, seg_len=4, skip=8)


@pytest.mark.slow  # whole training runs (15 s loaded)
def test_ablation_recl_and_report_end_to_end(ptb_dir, tmp_path, monkeypatch):
    assert ablation.main(ablation_args(ptb_dir, tmp_path)) == 0
    res = tmp_path / "results"
    a = json.loads((res / "ablation.json").read_text())
    assert set(a["runs"]) == {"relative-rec", "al_rfou-norec"}
    rel, van = a["runs"]["relative-rec"], a["runs"]["al_rfou-norec"]
    assert rel["init_len"] == 8 and van["init_len"] == 4  # memory + segment, segment alone
    for r in (rel, van):
        assert r["train"]["steps"] == 2 and math.isfinite(r["ppl_init"]) and r["ppl_best"] <= r["ppl_init"]
        assert r["best_len"] >= r["init_len"] and set(r["ppl"]) == {"4", "8", "12"}
    assert f"{rel['ppl_init']:.2f}" in (res / "ablation.md").read_text()
    assert (res / "ablation.png").stat().st_size > 0
    assert (tmp_path / "runs" / "relative-rec" / "losses-train-segments" / "c12.npy").is_file()

    # RECL reuses the trained models; it scores them with exactly c keys per query, once: a second run
    # reuses those losses too. No training, no re-evaluation.
    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(txl.train, "train", no_training)
    assert recl.main(ablation_args(ptb_dir, tmp_path)) == 0
    assert (tmp_path / "runs" / "relative-rec" / "losses" / "c12.npy").is_file()
    monkeypatch.setattr(common, "position_losses", no_training)
    assert recl.main(ablation_args(ptb_dir, tmp_path)) == 0
    r = json.loads((res / "recl.json").read_text())
    assert set(r["recl"]) == {"0.1", "0.5", "1.0"} and r["group"] == ["relative-rec", "al_rfou-norec"]
    assert all(v["recl"] in (4, 8, 12) for v in r["recl"]["1.0"].values())
    d, losses = r["diagnostics"]["relative-rec"], tmp_path / "runs" / "relative-rec" / "losses"
    assert d["ppl_first"] == pytest.approx(math.exp(np.load(losses / "c4.npy").mean()))
    moves = [np.abs(np.load(losses / f"c{b}.npy") - np.load(losses / f"c{a}.npy")).mean() for a, b in ((4, 8), (8, 12))]
    assert d["volatility"] == pytest.approx(np.mean(moves))
    assert (res / "recl.png").stat().st_size > 0

    assert speedup.main(["--results", str(res), "--shape", "tiny", "--lengths", "8,16", "--reps", "1"]) == 0
    doc = tmp_path / "docs" / "results.md"
    text = report.render(res, doc)
    assert "Reduced budget" in text and "results/ablation.png" in text
    sp = json.loads((res / "speedup.json").read_text())
    assert [r["length"] for r in sp["rows"]] == [8, 16] and all(r["speedup"] > 0 for r in sp["rows"])
    assert "| 16 |" in text and "FLOP ratio" in text  # the measured table, in the report
    assert f"{rel['ppl_best']:.2f}" in text and "27.02" in text  # ours from JSON, the paper's from paper.py


def test_ablation_rejects_grid_without_training_lengths(ptb_dir, tmp_path):
    with pytest.raises(SystemExit, match="training attention length"):
        ablation.main(ablation_args(ptb_dir, tmp_path, "--contexts", "4,12"))


@pytest.mark.slow  # whole training runs (10 s loaded)
def test_changed_config_is_not_silently_reused(ptb_dir, tmp_path):
    args = ablation_args(ptb_dir, tmp_path, "--variants", "relative-rec")
    assert ablation.main(args) == 0
    with pytest.raises(ValueError, match="another config"):
        ablation.main([*args, "--lr", "0.002"])


@pytest.mark.slow  # whole training runs (16 s loaded)
def test_a_run_with_other_kernels_is_the_same_run(ptb_dir, tmp_path):
    """A finished row trained with other kernel choices (here the defaults of before: nn.Dropout, recomputed
    attention) is skipped, not refused; a real change of config still is."""
    args = ablation_args(ptb_dir, tmp_path, "--variants", "relative-rec")
    assert ablation.main([*args, "--compute.dropout_impl", "torch", "--compute.recompute_attention", "true"]) == 0
    done = next((tmp_path / "runs").rglob("done.json"))
    before = done.read_text()
    assert ablation.main(args) == 0
    assert done.read_text() == before  # not trained again
    with pytest.raises(ValueError, match="another config"):
        ablation.main([*args, "--lr", "0.002"])


@pytest.mark.slow  # whole training runs (10 s loaded)
def test_char_driver(char_dir, tmp_path):
    args = ["--data-dir", str(char_dir), "--steps", "2", "--tgt-len", "4", "--mem-len", "4", "--contexts", "4,8,16",
            *TINY_MODEL, "--out", str(tmp_path / "char"), "--results", str(tmp_path / "results")]
    assert char.main(args) == 0
    c = json.loads((tmp_path / "results" / "char.json").read_text())
    assert c["train_attn_len"] == 8 and set(c["bpc"]) == {"4", "8", "16"}
    assert c["bpc_best"] == min(c["bpc"].values()) and (tmp_path / "results" / "char.png").stat().st_size > 0
    assert "bits per character" in report.render(tmp_path / "results", tmp_path / "docs" / "results.md")


def test_speedup_rejects_unknown_shape(tmp_path):
    with pytest.raises(SystemExit, match="not a benchmark shape"):
        speedup.main(["--results", str(tmp_path), "--shape", "huge", "--lengths", "8"])


def test_summary_and_findings_on_synthetic_losses():
    import argparse

    args = argparse.Namespace(tgt_len=4, mem_len=4)
    rng = np.random.default_rng(0)
    base = rng.uniform(2, 6, size=2000)
    better = {4: base + 0.2, 8: base + 0.1, 12: base}  # keeps improving with longer attention
    flat = {c: base + 0.3 + rng.normal(0, 0.01, size=base.size) for c in (4, 8, 12)}  # noise only
    rows = {"relative-rec": ablation.summarise(ablation.Variant("relative", True), better, args),
            "al_rfou-norec": ablation.summarise(ablation.Variant("al_rfou", False), flat, args)}
    rel, van = rows["relative-rec"], rows["al_rfou-norec"]
    assert rel["init_len"] == 8 and rel["best_len"] == 12 and rel["improves"]
    assert rel["ppl_init"] == pytest.approx(math.exp(np.mean(base) + 0.1))
    assert van["init_len"] == 4 and not van["improves"]
    f = ablation.findings(rows)
    assert f["recurrence_with_ours_is_best"] and f["only_ours_keeps_improving"]
    assert f["improving_with_longer_attention"] == ["relative-rec"]
    assert "ours_vs_best" not in ablation.findings(rows, {"relative-rec": better, "al_rfou-norec": flat})
    # A best run other than ours is compared with ours position by position: 0.05 nats worse everywhere.
    shaw = {c: a - 0.05 for c, a in better.items()}
    rows["shaw-rec"] = ablation.summarise(ablation.Variant("shaw", True), shaw, args)
    f = ablation.findings(rows, {"relative-rec": better, "shaw-rec": shaw})
    assert f["best_run"] == "shaw-rec" and not f["recurrence_with_ours_is_best"]
    assert f["ours_vs_best"]["gap_pct"] == pytest.approx(100 * (math.exp(0.05) - 1))
    assert f["ours_vs_best"]["gap_over_se"] > 1e6  # the same shift at every position: no noise


def test_logged_train_seconds_counts_each_step_once(tmp_path):
    """A resumed run's training time from its log: steps redone after a resume count once, at their last rate."""
    rows = [{"kind": "train", "step": s, "tokens": 10 * s, "tokens_per_s": rate} for s, rate in
            [(2, 10.0), (4, 10.0), (6, 5.0),  # interrupted after step 6; the checkpoint was at step 4
             (6, 20.0), (8, 20.0)]]  # resumed: steps 5-6 again, faster
    rows.insert(2, {"kind": "valid", "step": 4, "loss": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # steps 1-4 at 10 tok/s (4 s), 5-6 at 20 (1 s), 7-8 at 20 (1 s)
    assert common.logged_train_seconds(tmp_path) == pytest.approx(6.0)


@pytest.fixture
def wt2_dir(tmp_path, monkeypatch):
    """A tiny WikiText-2 look-alike: articles under ' = Title = ' lines, the files named as the real ones."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(2)
    d = tmp_path / "wikitext-2"
    d.mkdir()
    for split, n in (("train", 300), ("valid", 80), ("test", 20)):
        lines = [f" = Article {i} = " if i % 25 == 0 else _word_text(rng, 1).strip() for i in range(n)]
        (d / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n")
    return d


@pytest.mark.slow  # whole training runs (10 s loaded)
def test_wt2_grid_workers_half_loss_noise_and_report(wt2_dir, tmp_path, monkeypatch):
    """The WikiText-2 path end to end: two workers share the grid, the Half row trains with the last-half
    loss and the noise row with the next seed, results are rewritten from whatever is finished, and
    --report-only trains and scores nothing."""
    from experiments import grid

    res = tmp_path / "results"
    args = ["--corpus", "wt2", "--data-dir", str(wt2_dir), "--steps", "2", "--tgt-len", "4", "--mem-len", "4",
            "--contexts", "4,8,16", "--cutoffs", "", "--valid-tokens", "120", "--variants",
            "relative-rec,shaw-rec,relative-rec-half,relative-rec-seed1", *TINY_MODEL,
            "--runs-dir", str(tmp_path / "runs"), "--results", str(res)]
    with monkeypatch.context() as plots:  # plots only from the final --report-only (they dominate the time)
        for module, name in ((txl.train, "plot_learning_curve"), (ablation, "plot"), (ablation, "plot_long_memory"),
                             (recl, "plot")):
            plots.setattr(module, name, lambda *a, **k: None)
        assert grid.main([*args, "--worker", "0/2"]) == 0  # relative-rec and relative-rec-half
        a = json.loads((res / "ablation_wt2.json").read_text())
        assert set(a["runs"]) == {"relative-rec", "relative-rec-half"} and a["corpus"] == "wt2"
        half = json.loads((tmp_path / "runs" / "relative-rec-half" / "run.json").read_text())
        assert half["train"]["loss_positions"] == "last_half" and half["data"]["corpus"] == "wt2"
        assert a["runs"]["relative-rec-half"]["loss"] == "Half"
        claim = {(c["a"], c["b"]): c for c in a["claims"]["claims"]}
        assert claim[("relative-rec", "relative-rec-half")]["verdict"] != "not run yet"
        assert claim[("relative-rec", "shaw-rec")]["verdict"] == "not run yet" and a["claims"]["noise"] is None
        assert [p["attn_len"] for p in a["long_memory"]["relative-rec"]] == [8, 16]  # from the training length on
        text = report.render(res, tmp_path / "docs" / "results.md")
        assert "## 5. WikiText-2" in text and "**Incomplete.** 2 of 4 runs" in text and "`shaw-rec`" in text

        assert grid.main([*args, "--worker", "1/2"]) == 0  # shaw-rec and the noise run
        seed = json.loads((tmp_path / "runs" / "relative-rec-seed1" / "run.json").read_text())
        assert seed["train"]["seed"] == 1 and seed["train"]["loss_positions"] == "all"

    # The second block with clamped distances: identical up to the training attention length (8), not beyond.
    assert longmem.main(args) == 0
    c = json.loads((res / "longmem_clamp_wt2.json").read_text())
    assert set(c["runs"]) == {"relative-rec", "relative-rec-half", "relative-rec-seed1"}
    run = c["runs"]["relative-rec"]
    assert run["clamp_len"] == run["train_attn_len"] == 8
    assert [p["attn_len"] for p in run["clamped"]] == [8, 16]
    assert run["clamped"][0]["ppl"] == run["unclamped"][0]["ppl"] and run["clamped"][1]["ppl"] != \
        run["unclamped"][1]["ppl"]
    lm = json.loads((res / "ablation_wt2.json").read_text())["long_memory"]["relative-rec"]
    assert [p["ppl"] for p in run["unclamped"]] == [p["ppl"] for p in lm]  # the ablation's own cached losses

    def nothing(*a, **k):
        raise AssertionError("--report-only trained or scored")
    monkeypatch.setattr(txl.train, "train", nothing)
    monkeypatch.setattr(common, "position_losses", nothing)
    assert grid.main([*args, "--report-only"]) == 0
    a = json.loads((res / "ablation_wt2.json").read_text())
    assert len(a["runs"]) == 4 and "--worker" not in a["command"] and "--report-only" not in a["command"]
    noise = a["claims"]["noise"]
    gap = ablation.compare("relative-rec", "relative-rec-seed1",
                           {n: {"best_len": r["best_len"], "ppl_best": r["ppl_best"]} for n, r in a["runs"].items()},
                           {n: {c: np.load(tmp_path / "runs" / n / "losses-train-segments" / f"c{c}.npy")
                                for c in (4, 8, 16)} for n in a["runs"]})
    assert noise == pytest.approx(gap)
    assert {c["verdict"] for c in a["claims"]["claims"]} <= {"reproduced", "reversed", "within noise", "not run yet"}
    assert json.loads((res / "recl_wt2.json").read_text())["group"] == ["relative-rec", "shaw-rec"]  # Table 8's
    assert (res / "longmem_wt2.png").stat().st_size > 0 and (res / "ablation_wt2.png").stat().st_size > 0
    text = report.render(res, tmp_path / "docs" / "results.md")
    assert "Incomplete" not in text and f"{a['runs']['relative-rec-half']['ppl_best']:.2f}" in text
    assert "distances clamped at the training attention length" in text and "*With clamped distances*" in text


def test_ptb_stays_the_default_corpus():
    args = ablation.parse_args([])
    assert args.corpus == "ptb" and args.data_dir.endswith("ptb") and args.steps == 12000 and args.tgt_len == 32
    assert [v.name for v in ablation.variants_of(args)] == [v.name for v in ablation.VARIANTS]
    wt2 = ablation.parse_args(["--corpus", "wt2", "--steps", "10"])
    assert wt2.steps == 10 and wt2.data_dir.endswith("wikitext-2") and wt2.out.endswith("ablation-wt2")
    names = [v.name for v in ablation.variants_of(wt2)]
    assert names[:4] == ["relative-rec", "shaw-rec", "relative-norec", "relative-rec-seed1"] and len(names) == 12
    assert {a for a, _, _ in ablation.CLAIMS} | {b for _, b, _ in ablation.CLAIMS} <= set(names)


def test_grid_claim_skips_a_run_held_by_a_live_worker_and_takes_a_stale_one(tmp_path):
    from experiments import grid

    run = tmp_path / "relative-rec"
    with grid.claim(run) as first, grid.claim(run) as second:
        assert first and not second and grid.lock_path(run).is_file()
    assert not grid.lock_path(run).exists()  # released
    for owner in ({"pid": os.getpid(), "boot": "another boot"}, "not json"):  # a previous boot's, or corrupt
        grid.lock_path(run).write_text(json.dumps(owner) if isinstance(owner, dict) else owner)
        with grid.claim(run) as mine:
            assert mine


def test_drivers_take_config_fields_as_txl_train_does():
    """--SECTION.FIELD works in the drivers: a shortcut's field sets the shortcut, any other field reaches every
    run's config, a field the grid sets per run is refused, and the two forms cannot disagree."""
    args = ablation.parse_args(["--corpus", "wt2", "--model.n_layer", "2", "--train.max_steps", "30",
                                "--model.dropatt", "0.2", "--optim.weight_decay", "0.01"])
    assert args.n_layer == 2 and args.steps == 30 and args.config == {"model.dropatt": "0.2",
                                                                       "optim.weight_decay": "0.01"}
    with pytest.raises(AttributeError, match="read-only once resolved"):
        args.steps = 1  # every run reads the settings as resolved: no driver changes them on the way
    cfg = ablation.run_config(ablation.Variant("shaw", False, "Half"), args, vocab_size=20000)
    assert (cfg.model.n_layer, cfg.train.max_steps, cfg.model.dropatt, cfg.optim.weight_decay) == (2, 30, 0.2, 0.01)
    assert (cfg.model.attn_type, cfg.model.mem_len, cfg.train.loss_positions) == ("shaw", 0, "last_half")
    assert ablation.parse_args(["--model.cutoffs", "10,20"]).cutoffs == "10,20"
    assert ablation.parse_args(["--n-layer", "2", "--model.n_layer", "2"]).n_layer == 2  # agreeing is fine
    with pytest.raises(SystemExit, match="disagree"):
        ablation.parse_args(["--n-layer", "3", "--model.n_layer", "2"])
    with pytest.raises(SystemExit, match="--model.attn_type: each run's encoding is its variant's"):
        ablation.parse_args(["--model.attn_type", "shaw"])
    with pytest.raises(SystemExit, match=r"unknown field model.n_layers \(did you mean n_layer\?\); "
                       r"valid model fields are: .*n_layer"):
        ablation.parse_args(["--model.n_layers", "2"])
    with pytest.raises(ValueError, match="model.n_layer='two' must be an integer"):
        ablation.parse_args(["--model.n_layer", "two"])
    c = char.resolve(_char_parser().parse_args(["--optim.lr", "0.003", "--model.pre_ln", "true"]))
    assert c.lr == 0.003 and c.config == {"model.pre_ln": "true"}
    assert char.run_config(c, vocab_size=50).model.pre_ln is True


def _char_parser():
    import argparse

    p = argparse.ArgumentParser()
    char.add_arguments(p)
    return p
