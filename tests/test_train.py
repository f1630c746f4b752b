"""Training, resume, evaluation and fault handling on a tiny model over a small generated text."""

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import txl.checkpoint
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


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    path = tmp_path / "code.txt"
    path.write_text(text)
    return str(path)


def args(corpus, out, *more):
    return [*TINY, "--data.corpus", corpus, "--data.level", "byte", "--out", str(out), *more]


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


def test_time_budget_sets_the_schedule_horizon():
    """20 steps in 10 s with 100 s left: 90% of the remaining 90 s at 2 steps/s is 162 more steps."""
    single = txl.train.DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
    assert txl.train._time_horizon(20, 20, 10.0, 100.0, 10_000, single) == 20 + 162
    assert txl.train._time_horizon(20, 20, 10.0, 100.0, 50, single) == 50  # max_steps comes first
    assert txl.train._time_horizon(20, 20, 200.0, 100.0, 10_000, single) == 21  # over budget: stop next
    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(182, cos, 182) == pytest.approx(0.1)  # the decay completes at the horizon


def test_resume_is_bit_identical(corpus, tmp_path, monkeypatch, capsys):
    assert main(["train", *args(corpus, tmp_path / "a", "--max-steps", "6", "--train.grad_accum", "2")]) == 0
    calls = {"n": 0}
    real = txl.train.train_step

    def crash_at_step_5(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(txl.train, "train_step", crash_at_step_5)
    assert main(["train", *args(corpus, tmp_path / "b", "--max-steps", "6", "--train.grad_accum", "2")]) == 130
    assert "resume with: txl train --resume" in capsys.readouterr().err
    monkeypatch.setattr(txl.train, "train_step", real)
    assert max(losses(tmp_path / "b")) == 4  # steps 1-4 logged, checkpoint at step 3
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == list(range(1, 7)) and a == b  # exact equality of every float


def test_eval_cli_and_sweep(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *args(corpus, out, "--max-steps", "3")]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--mem-len", "24", "--clamp-len", "16", "--same-length", "--tgt-len", "4",
                 "--max-batches", "3"]) == 0
    assert "mem_len 24, tgt_len 4: loss" in capsys.readouterr().out
    assert main(["eval", str(out), "--sweep-mem", "0,8,16", "--max-batches", "2"]) == 0
    table = capsys.readouterr().out
    assert "attn_len" in table and len([r for r in table.splitlines() if r.strip().startswith("16 ")]) == 1
    assert any(out.glob("checkpoints/*/mem_sweep.png"))


def test_default_job_runs_for_seconds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--max-steps", "2", "--data.max_bytes", "30000", "--model.n_layer", "1",
                 "--train.sample_tokens", "5", "--train.eval_batches", "1", "--eval.batch_size", "2"]) == 0
    out = capsys.readouterr().out
    assert "test (mem_len 192, trained with 64)" in out and "sample (prompt >>> continuation)" in out
    run = tmp_path / "runs" / "default"
    assert (run / "learning_curve.png").is_file() and (run / "best.json").is_file()
    model = txl.from_pretrained(txl.checkpoint.find_checkpoint(run, "best"))  # a plain model directory too
    assert model.config.vocab_size == 256


def test_tensorboard_events(corpus, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install 'txl[tb]')")
    assert main(["train", *args(corpus, tmp_path / "r", "--max-steps", "2", "--train.tensorboard", "true")]) == 0
    assert any((tmp_path / "r" / "tb").iterdir())


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
    txl.checkpoint.load_checkpoint(out)


def test_killed_mid_checkpoint_keeps_previous(corpus, tmp_path, monkeypatch):
    real = txl.checkpoint._write_state

    def die_on_second(path, state):
        if state["step"] == 6:
            Path(path).write_bytes(b"partial")
            raise KeyboardInterrupt  # the process is killed while writing
        real(path, state)

    monkeypatch.setattr(txl.checkpoint, "_write_state", die_on_second)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "8")]) == 130
    assert json.loads((out / "latest.json").read_text())["step"] == 3
    assert not list((out / "checkpoints").glob(".tmp-*")) and not (out / "checkpoints" / "step_00000006").exists()
    assert txl.checkpoint.load_checkpoint(out).state["step"] == 3


def test_disk_full_is_one_clear_line(corpus, tmp_path, monkeypatch, capsys):
    real = txl.checkpoint._write_state

    def full(path, state):
        if state["step"] == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, state)

    monkeypatch.setattr(txl.checkpoint, "_write_state", full)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "8")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "No space left on device" in err and "step_00000003 is intact" in err and "--resume" in err
    assert txl.checkpoint.load_checkpoint(out).state["step"] == 3


def test_corrupt_and_truncated_checkpoints(corpus, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "3")]) == 0
    ckpt = txl.checkpoint.find_checkpoint(out)
    state = ckpt / "train_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    assert main(["train", "--resume", str(out)]) == 2
    assert "train_state.pt is corrupt or truncated" in capsys.readouterr().err
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    assert main(["eval", str(out)]) == 2
    assert "model.safetensors is corrupt or truncated" in capsys.readouterr().err


def test_vocabulary_must_match_checkpoint(corpus, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "1", "--data.level", "char")]) == 0
    other = tmp_path / "other.txt"
    other.write_text("abc abd abe\n" * 300)
    assert main(["eval", str(out), "--corpus", str(other)]) == 2
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
    assert "unknown field model.mem_lenn; valid model fields are:" in err and "mem_len" in err
    assert main(["train", "--optim.lr", "fast"]) == 2
    assert "optim.lr='fast' must be a number" in capsys.readouterr().err
    assert main(["train", "--train.batch_size", "10", "--train.grad_accum", "3"]) == 2
    assert "divisible by grad_accum" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    assert proc.stdout.count("trained 4 steps") == 1 and proc.stderr.count("final valid") == 1  # and prints
