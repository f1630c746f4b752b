"""Training, resume, evaluation and fault handling on a tiny model over a small generated text."""

import contextlib
import errno
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import txl.checkpoint
import txl.metrics
import txl.rundir
import txl.train
from txl.cli import main
from txl.config import OptimConfig
from txl.optim import lr_at

TINY = ["--preset", "tiny", "--model.n_layer", "1", "--model.d_model", "32", "--model.n_head", "2",
        "--model.d_head", "16", "--model.d_inner", "64", "--model.mem_len", "8", "--train.tgt_len", "8",
        "--train.batch_size", "4", "--train.log_interval", "1", "--train.progress", "false",
        "--train.tensorboard", "false", "--train.plot", "false", "--eval.batch_size", "2",
        "--eval.mem_len", "16", "--train.eval_batches", "2", "--train.eval_interval", "0",
        "--train.ckpt_interval", "3"]


def args(corpus, out, *more):
    return [*TINY, "--data.corpus", corpus, "--data.level", "byte", "--out", str(out), *more]


@contextlib.contextmanager
def interrupted_at_step(monkeypatch, n: int):
    """Within the block, txl.train's train_step is interrupted (Ctrl-C: KeyboardInterrupt) at its n-th call;
    the real one is back after it."""
    real, calls = txl.train.train_step, {"n": 0}

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(txl.train, "train_step", crash)
    try:
        yield
    finally:
        monkeypatch.setattr(txl.train, "train_step", real)


def losses(out):
    rows = [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_lr_schedules_are_pure():
    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cos, 110) == pytest.approx(0.1) and lr_at(9, cos, 110) == pytest.approx(1.0)
    assert lr_at(10, cos, 110) == pytest.approx(1.0) and lr_at(60, cos, 110) == pytest.approx(0.55)
    assert lr_at(110, cos, 110) == pytest.approx(0.1) and lr_at(500, cos, 110) == pytest.approx(0.1)
    inv = OptimConfig(lr=1.0, schedule="inv_sqrt", warmup_steps=4)
    assert lr_at(15, inv, 100) == pytest.approx(0.5)
    assert lr_at(50, OptimConfig(lr=0.3, schedule="constant"), 10) == 0.3


def test_learning_curve_plots_the_runs_metric_not_nats():
    from txl.metrics import learning_curve_points

    rows = [{"kind": "train", "step": 1, "loss": math.log(2) * 3}, {"kind": "valid", "step": 1, "loss": 2.0},
            {"kind": "test", "step": 1, "loss": 9.0}]
    bpc = learning_curve_points(rows, "bpc")
    assert bpc["train"] == [(1, pytest.approx(3.0))] and bpc["valid"] == [(1, pytest.approx(2.0 / math.log(2)))]
    assert learning_curve_points(rows, "ppl")["valid"] == [(1, pytest.approx(math.exp(2.0)))]
    assert set(bpc) == {"train", "valid"}


def test_time_budget_sets_the_schedule_horizon():
    """20 steps in 10 s with 100 s budget: the remaining 90 s at 2 steps/s is 180 more steps."""
    single = txl.train.DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
    assert txl.train.time_horizon(20, 20, 10.0, 100.0, 10_000, single) == 20 + 180
    assert txl.train.time_horizon(20, 20, 10.0, 100.0, 50, single) == 50  # max_steps comes first
    assert txl.train.time_horizon(20, 20, 200.0, 100.0, 10_000, single) == 21  # over budget: stop next
    # Re-estimated later from the whole run: 100 steps in 80 s (a validation slowed it) leave 20 s at 1.25/s.
    assert txl.train.time_horizon(100, 100, 80.0, 100.0, 10_000, single) == 125
    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(200, cos, 200) == pytest.approx(0.1)  # the decay completes at the horizon


@pytest.mark.slow  # real training
def test_resume_is_bit_identical(corpus, tmp_path, monkeypatch, capsys):
    assert main(["train", *args(corpus, tmp_path / "a", "--max-steps", "6", "--train.grad_accum", "2")]) == 0
    with interrupted_at_step(monkeypatch, 5):
        assert main(["train", *args(corpus, tmp_path / "b", "--max-steps", "6", "--train.grad_accum", "2")]) == 130
    assert "resume with: txl train --resume" in capsys.readouterr().err
    assert max(losses(tmp_path / "b")) == 4  # steps 1-4 logged, checkpoint at step 3
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == list(range(1, 7)) and a == b  # exact equality of every float


@pytest.mark.slow  # real training
def test_resume_from_a_flat_train_state_of_an_older_version(corpus, tmp_path):
    """Checkpoints written before the stateful parts had their own keys still resume, bit-identically."""
    assert main(["train", *args(corpus, tmp_path / "a", "--max-steps", "5")]) == 0
    assert main(["train", *args(corpus, tmp_path / "b", "--max-steps", "3")]) == 0
    state_file = txl.rundir.find_checkpoint(tmp_path / "b") / "train_state.pt"
    parts = torch.load(state_file, weights_only=True)
    train = parts["train"]
    flat = {"optimizer": parts["optimizer"], "scaler": parts["scaler"], "step": train["step"],
            "tokens": train["tokens"], "best_valid": train["best_valid"], "horizon": train["horizon"],
            "iterator": train["iterator"], "rng": [r["rng"] for r in train["ranks"]],
            "memories": [r["memories"] for r in train["ranks"]], "world_size": 1}
    torch.save(flat, state_file)
    assert main(["train", "--resume", str(tmp_path / "b"), "--max-steps", "5"]) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


@pytest.mark.slow  # real training
def test_eval_cli_and_sweep(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", *args(corpus, out, "--max-steps", "3")]) == 0
    capsys.readouterr()
    evaluate = ["eval", str(out), "--eval.mem_len", "24", "--eval.clamp_len", "16", "--eval.same_length",
                "--eval.tgt_len", "4", "--max-batches", "3"]
    assert main(evaluate) == 0
    redirected, err = capsys.readouterr()
    assert "segment" not in err and "\x1b" not in err  # stderr is not a terminal: no bar, no cursor escapes
    monkeypatch.setattr(txl.metrics, "_is_terminal", lambda stream: True)
    assert main(evaluate) == 0
    printed, err = capsys.readouterr()
    assert printed.split(" tokens, ")[0] == redirected.split(" tokens, ")[0]  # the same figures (up to tokens/s)
    assert "test:" in err and "/3 " in err and "segment" in err  # the evaluation's own bar, on a terminal
    assert "test (first 3 segments, 2 streams, tgt_len 4, mem_len 24, clamp_len 16, same_length;" in printed
    assert "mem_len 24, tgt_len 4, keys/query 24: loss" in printed
    assert main(["eval", str(out), "--sweep-mem", "0,8,16", "--max-batches", "2", "--no-progress"]) == 0
    table, err = capsys.readouterr()
    assert "segment" not in err and "sweep" not in err
    assert "keys/query" in table and len([r for r in table.splitlines() if r.strip().startswith("16 ")]) == 1
    assert (out / "mem_sweep.png").is_file()  # the run directory: pruning never deletes it
    rows = (out / "mem_sweep.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["mem_len", "keys/query", "loss", "bpc", "tokens/s"] and len(rows) == 4
    assert rows[1].split("\t")[:2] == ["0", "1-8"]  # without same_length query t sees mem_len + t + 1 keys


@pytest.mark.slow  # real training
def test_eval_of_a_compressive_run_counts_and_names_the_compressed_slots(corpus, tmp_path, capsys):
    """A compressive run (cmem_len 4 at rate 2): every settings line names its second memory, keys/query counts the
    compressed slots every query reads (issue 44: `1-32` with mem_len 0, `17-48` at mem_len 16, tgt_len 32), and
    eval refuses mem_len 0 as training does."""
    out = tmp_path / "run"
    compressive = ["--model.cmem_len", "4", "--model.cmem_rate", "2", "--model.cmem_fn", "max"]
    assert main(["train", *args(corpus, out, "--max-steps", "2", *compressive)]) == 0
    printed = capsys.readouterr().out
    assert "valid (best checkpoint, step 2; tgt_len 8, mem_len 8, cmem_len 4 at rate 2 (max), 2 streams" in printed
    assert "test (best checkpoint, step 2; tgt_len 8, mem_len 16, cmem_len 4 at rate 2 (max)," in printed
    assert main(["eval", str(out), "--max-batches", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "test (first 2 segments, 2 streams, tgt_len 8, mem_len 16, cmem_len 4 at rate 2 (max);" in printed
    assert "mem_len 16, cmem_len 4, tgt_len 8, keys/query 21-28: loss" in printed  # 4 + 16 + 1 .. 4 + 16 + 8
    assert main(["eval", str(out), "--sweep-mem", "2,8", "--max-batches", "2", "--no-progress"]) == 0
    capsys.readouterr()
    rows = [r.split("\t")[:2] for r in (out / "mem_sweep.tsv").read_text().splitlines()[1:]]
    assert rows == [["2", "7-14"], ["8", "13-20"]]
    for bad in (["--eval.mem_len", "0"], ["--sweep-mem", "0,8"]):
        assert main(["eval", str(out), *bad, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "mem_len 0 with a compressive model (cmem_len 4)" in err and "--eval.mem_len >= 1" in err, err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.slow  # real training
def test_eval_refuses_same_length_without_memory(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *args(corpus, out, "--max-steps", "1")]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--eval.same_length", "--sweep-mem", "0,8"]) == 2
    err = capsys.readouterr().err
    assert "same_length with mem_len 0 masks every key" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # real training
def test_eval_says_clamp_len_does_not_apply_to_shaw(corpus, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    assert main(["train", *args(corpus, out, "--max-steps", "1", "--model.attn_type", "shaw")]) == 0
    assert main(["eval", str(out), "--eval.clamp_len", "4", "--max-batches", "1"]) == 0
    assert "eval.clamp_len=4 does not apply to attn_type='shaw'" in caplog.text
    assert "model.learned_positions" in caplog.text


@pytest.mark.slow
def test_default_job_runs_for_seconds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--max-steps", "2", "--data.max_bytes", "30000", "--model.n_layer", "1",
                 "--train.sample_tokens", "5", "--train.eval_batches", "1", "--eval.batch_size", "2"]) == 0
    out = capsys.readouterr().out
    assert "test (best checkpoint, step 2; tgt_len 64, mem_len 192, 2 streams, whole split; trained with mem_len 64" \
        in out and "sample (prompt >>> continuation)" in out
    run = tmp_path / "runs" / "default"
    assert (run / "learning_curve.png").is_file() and (run / "best.json").is_file()
    model = txl.from_pretrained(txl.rundir.find_checkpoint(run, "best"))  # a plain model directory too
    assert model.config.vocab_size == 256


@pytest.mark.slow  # real training
def test_tensorboard_events(corpus, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install 'txl[tb]')")
    assert main(["train", *args(corpus, tmp_path / "r", "--max-steps", "2", "--train.tensorboard", "true")]) == 0
    assert any((tmp_path / "r" / "tb").iterdir())


@pytest.mark.slow  # real training
def test_nan_loss_stops_with_last_good_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    real = txl.train.train_step
    calls = {"n": 0}

    def nan_at_step_5(*a, **k):
        calls["n"] += 1
        stats, mem = real(*a, **k)
        if calls["n"] == 5:
            stats.loss = float("nan")
        return stats, mem

    monkeypatch.setattr(txl.train, "train_step", nan_at_step_5)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "8")]) == 1
    err = capsys.readouterr().err
    assert "loss is nan at step 5" in err and "step_00000003" in err and "Traceback" not in err
    assert json.loads((out / "latest.json").read_text())["step"] == 3
    txl.checkpoint.load(out)


@pytest.mark.slow  # real training
def test_killed_mid_checkpoint_keeps_previous(corpus, tmp_path, monkeypatch):
    real = txl.checkpoint._write_state

    def die_on_second(path, state):
        if state["train"]["step"] == 6:
            Path(path).write_bytes(b"partial")
            raise KeyboardInterrupt  # the process is killed while writing
        real(path, state)

    monkeypatch.setattr(txl.checkpoint, "_write_state", die_on_second)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "8")]) == 130
    assert json.loads((out / "latest.json").read_text())["step"] == 3
    assert not list((out / "checkpoints").glob(".tmp-*")) and not (out / "checkpoints" / "step_00000006").exists()
    assert txl.checkpoint.load(out).state["train"]["step"] == 3


@pytest.mark.slow  # real training
def test_disk_full_is_one_clear_line(corpus, tmp_path, monkeypatch, capsys):
    real = txl.checkpoint._write_state

    def full(path, state):
        if state["train"]["step"] == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, state)

    monkeypatch.setattr(txl.checkpoint, "_write_state", full)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "8")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "No space left on device" in err and "step_00000003 is intact" in err and "--resume" in err
    assert txl.checkpoint.load(out).state["train"]["step"] == 3


@pytest.mark.slow  # real training
def test_corrupt_and_truncated_checkpoints(corpus, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "3")]) == 0
    ckpt = txl.rundir.find_checkpoint(out)
    state = ckpt / "train_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    assert main(["train", "--resume", str(out)]) == 2
    assert "train_state.pt is corrupt or truncated" in capsys.readouterr().err
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    assert main(["eval", str(out)]) == 2
    assert "model.safetensors is corrupt or truncated" in capsys.readouterr().err


@pytest.mark.slow  # real training
def test_vocabulary_must_match_checkpoint(corpus, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "1", "--data.level", "char")]) == 0
    other = tmp_path / "other.txt"
    other.write_text("abc abd abe\n" * 300)
    assert main(["eval", str(out), "--data.corpus", str(other)]) == 2
    err = capsys.readouterr().err
    assert "the corpus vocabulary (char level, 8 symbols) does not match the checkpoint's" in err


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"), (b"", "empty"), (b"\xff\xfe\xfa bad bytes " * 50, "UTF-8"),
])
def test_bad_corpus_is_one_line(tmp_path, monkeypatch, capsys, content, message):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "c.txt"
    if content is not None:
        path.write_bytes(content)
    code = main(["train", *TINY, "--data.corpus", str(path), "--data.level", "char", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_overrides_on_command_line(capsys):
    assert main(["train", "--model.mem_lenn", "3"]) == 2
    err = capsys.readouterr().err
    assert "unknown field model.mem_lenn (did you mean mem_len?); valid model fields are:" in err and "mem_len" in err
    assert main(["train", "--optim.lr", "fast"]) == 2
    assert "optim.lr='fast' must be a number" in capsys.readouterr().err
    assert main(["train", "--train.batch_size", "10", "--train.grad_accum", "3"]) == 2
    assert "train.batch_size=10 must be divisible by 1 process(es) x grad_accum=3" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_two_processes_match_single(corpus, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert main(["train", *args(corpus, single, "--max-steps", "4", "--model.dropout", "0")]) == 0  # per-rank dropout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(txl.__file__).parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "txl", "train",
           *args(corpus, multi, "--max-steps", "4", "--model.dropout", "0")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = losses(single), losses(multi)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor([b[s] for s in a]), torch.tensor(list(a.values())), rtol=1e-4, atol=1e-4)
    assert not (multi / "metrics.jsonl").read_text().count('"step": 1,') > 1  # only rank 0 logs
    assert proc.stdout.count("trained 4 steps") == 1  # only rank 0 prints
    assert proc.stdout.count("test (best checkpoint") == 1, proc.stdout[-3000:]  # the final figures: once
    assert "of the best checkpoint" not in proc.stderr, proc.stderr[-3000:]  # not a second time in the log


@pytest.mark.slow  # real training
def test_best_checkpoint_compares_like_with_like(corpus, tmp_path, monkeypatch):
    """Periodic validation reads 2 segments, the end of training the whole split. Here the partial estimate
    ranks the final model first and the full one ranks it worse than step 3's partial figure: the best
    decision must use the partial estimate both times (before, the final full 1.5 lost to step 3's 1.0)."""
    real = txl.train.evaluate
    seen = []

    def fake(model, tokens, *, max_batches=0, **kw):
        result = real(model, tokens, max_batches=max_batches, **kw)
        seen.append(max_batches)
        partial = {1: 1.0, 2: 0.9}  # the 1st and 2nd partial validations: step 3, then the final model
        loss = partial[seen.count(2)] if max_batches == 2 else 1.5
        return txl.evaluate.EvalResult(loss=loss, tokens=result.tokens, seconds=result.seconds, metric=result.metric)

    monkeypatch.setattr(txl.train, "evaluate", fake)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "6", "--train.eval_interval", "3")]) == 0
    assert json.loads((out / "best.json").read_text())["step"] == 6
    assert seen == [2, 2, 0, 0]  # step 3 partial, final partial (the decision), full valid, test
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows if r["kind"] == "valid"] == [(3, 1.0), (6, 0.9)]


def test_pre_split_directory_names(tmp_path):
    """Own pre-split corpora: train.txt, train.tokens, wiki.train.tokens ... are found; otherwise one line says
    which files were there."""
    from txl.data.corpora import split_files

    for names in (["train.txt", "valid.txt", "test.txt"], ["train.raw", "valid.bin", "test.tokens"],
                  ["wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"]):
        d = tmp_path / names[0].replace(".", "_")
        d.mkdir()
        for n in names:
            (d / n).write_text("a b c\n")
        assert [f.name for f in split_files(d)] == names
    d = tmp_path / "partial"
    d.mkdir()
    (d / "train.txt").write_text("x")
    (d / "dev.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"found valid: none; test: none among dev.txt, train.txt$"):
        split_files(d)


GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"
GOLDEN_ARGS = ["--preset", "tiny", "--data.level", "byte", "--max-steps", "8", "--train.log_interval", "1",
               "--train.eval_interval", "0", "--train.ckpt_interval", "0", "--train.progress", "false",
               "--train.tensorboard", "false", "--train.plot", "false"]


def golden_corpus(directory: Path) -> Path:
    """A generated text (the same on every machine, unlike the stdlib corpus of the tiny preset)."""
    path = directory / "golden.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    return path


def golden_losses(directory: Path) -> dict[int, float]:
    out = directory / "run"
    assert main(["train", *GOLDEN_ARGS, "--data.corpus", str(golden_corpus(directory)), "--out", str(out)]) == 0
    return losses(out)


def test_golden_losses_of_the_tiny_preset(tmp_path, monkeypatch):
    """The tiny preset's first 8 training losses, seed 0, against the recorded ones (any change to the model,
    initialisation, data order or optimiser moves them by far more than 1e-4)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    golden = json.loads(GOLDEN.read_text())
    got = golden_losses(tmp_path)
    assert sorted(got) == list(range(1, 9))
    for step, loss in golden["losses"].items():
        assert got[int(step)] == pytest.approx(loss, abs=1e-4), step


if __name__ == "__main__":  # python tests/test_train.py: record the golden losses again (after a deliberate change)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        recorded = golden_losses(Path(tmp))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"command": "python tests/test_train.py", "args": GOLDEN_ARGS,
                                  "torch": torch.__version__, "losses": recorded}, indent=2) + "\n")
    print(f"wrote {GOLDEN}")


def test_checkpoints_from_before_the_training_state_key_are_read():
    """Old checkpoints kept step, tokens, ... at the top level with one RNG state and memory list per process;
    checkpoint.load reads them into today's parts (the one converter)."""
    old = {"optimizer": {}, "scaler": {}, "step": 6, "tokens": 96, "best_valid": 1.5, "horizon": 0,
           "iterator": {"pos": 3}, "rng": ["r0", "r1"], "memories": [[None], [None]], "world_size": 2}
    state = txl.checkpoint._from_flat(old)
    assert state["train"] == {"step": 6, "tokens": 96, "best_valid": 1.5, "horizon": 0, "iterator": {"pos": 3},
                              "ranks": [{"rng": "r0", "memories": [None]}, {"rng": "r1", "memories": [None]}]}
    assert (state["optimizer"], state["scaler"]) == ({}, {})
    assert txl.checkpoint._from_flat(state) is state  # today's layout passes through
