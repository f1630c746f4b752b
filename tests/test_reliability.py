"""Nothing is ever lost: run-directory refusal and lock, signals, divergence, full disks, durable writes.

Real processes and real signals where the fault is a process-level one (lock, SIGTERM, SIGINT, kill -9);
in-process runs of ``txl.cli.main`` with an injected failure elsewhere.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import txl
import txl.checkpoint
import txl.rundir
import txl.train
from txl.cli import main
from txl.evaluate import EvalResult

TINY = ["--preset", "tiny", "--model.n_layer", "1", "--model.d_model", "32", "--model.n_head", "2",
        "--model.d_head", "16", "--model.d_inner", "64", "--model.mem_len", "8", "--train.tgt_len", "8",
        "--train.batch_size", "4", "--train.log_interval", "1", "--train.progress", "false",
        "--train.tensorboard", "false", "--train.plot", "false", "--eval.batch_size", "2",
        "--eval.mem_len", "16", "--train.eval_batches", "2", "--train.eval_interval", "0",
        "--train.ckpt_interval", "3", "--train.sample_tokens", "0", "--model.dropout", "0",
        "--optim.schedule", "constant", "--optim.warmup_steps", "0"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: threads only contend on a shared CPU."""


def args(corpus, out, *more):
    return [*TINY, "--data.corpus", corpus, "--data.level", "byte", "--out", str(out), *more]


def losses(out):
    rows = [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def snapshot(directory):
    """Every file's bytes and modification time, the lock file aside (it records who holds it)."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(Path(directory).rglob("*")) if p.is_file() and p.name != "train.lock"}


def strict_json(path):
    """json.loads, but a bare NaN/Infinity (which Python's json accepts) is an error, as in JSON."""
    def refuse(name):
        raise ValueError(f"{path} holds {name}, which is not JSON")
    return json.loads(Path(path).read_text(), parse_constant=refuse)


def spawn_training(corpus, out, *more, resume=False):
    """A real `txl train` process, output captured; ``resume``: `txl train --resume out`. It inherits this
    process's environment as it is: its OpenMP runtime then starts as the in-process runs' did (OMP_NUM_THREADS
    set or not), and `txl train` picks the same thread count (txl.runtime.choose_threads). Forcing
    OMP_NUM_THREADS=1 here alone made the weights differ in the last bits from the in-process runs when the
    suite ran without it (CI): one thread set by torch.set_num_threads after a 2-thread OpenMP start is not
    bitwise the same as an OpenMP runtime started with one."""
    env = {**os.environ, "PYTHONPATH": str(Path(txl.__file__).parents[1])}
    train_args = ["--resume", str(out), *more] if resume else args(corpus, out, *more)
    cmd = [sys.executable, "-m", "txl", "train", *train_args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(proc, out, n, timeout=60.0):
    """Until the process has logged ``n`` training steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        metrics = Path(out) / "metrics.jsonl"
        if metrics.is_file() and len(losses(out)) >= n:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} steps within {timeout} s")


# -- the run directory --------------------------------------------------------------------------------

@pytest.mark.slow  # real training
def test_used_run_directory_refused_and_left_unchanged(corpus, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "3")]) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main(["train", *args(corpus, out, "--max-steps", "4")]) == 2
    err = capsys.readouterr().err
    assert err == (f"txl train: error: {out} already holds a run (best.json, checkpoints/, latest.json, "
                   f"metrics.jsonl, ...); continue it with txl train --resume {out}, start again with "
                   "--overwrite (deletes it), or choose another --out\n")
    assert snapshot(out) == before  # not one byte or timestamp of the earlier run changed
    assert main(["train", "--resume", str(out), "--overwrite"]) == 2
    assert "--resume continues a run and --overwrite deletes it; give one of them" in capsys.readouterr().err
    assert snapshot(out) == before


@pytest.mark.slow  # real training
def test_overwrite_starts_afresh_and_spares_foreign_files(corpus, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "6")]) == 0
    assert main(["train", *args(corpus, out, "--max-steps", "2", "--overwrite")]) == 0
    assert sorted(losses(out)) == [1, 2]  # no row of the earlier run
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]  # its checkpoints gone
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["train", *args(corpus, out, "--max-steps", "2", "--overwrite")]) == 2
    assert f"--overwrite deletes only a run's own files, and {out} also holds notes.txt" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine" and (out / "checkpoints" / "step_00000002").is_dir()


@pytest.mark.slow  # real processes
def test_second_process_refused_by_the_lock(corpus, tmp_path, capsys):
    out = tmp_path / "r"
    first = spawn_training(corpus, out, "--max-steps", "100000", "--train.ckpt_interval", "1")
    try:
        wait_for_steps(first, out, 2)  # so latest.json exists and --resume gets as far as the lock
        metrics = (out / "metrics.jsonl").read_text()
        for extra in ([], ["--overwrite"], ["--resume", str(out)]):
            cmd = ["train", "--resume", str(out)] if extra[:1] == ["--resume"] else \
                ["train", *args(corpus, out, "--max-steps", "3"), *extra]
            assert main(cmd) == 2
            err = capsys.readouterr().err
            assert err == (f"txl train: error: {out} is in use by another training process (pid {first.pid}, "
                           f"lock {out / 'train.lock'}); wait for it to finish or stop it, or train into "
                           "another --out\n"), err
        assert (out / "metrics.jsonl").read_text().startswith(metrics)  # the first run's rows are intact
    finally:
        first.kill()
        first.communicate()
    # The kernel dropped the lock with the killed process: the directory can be resumed (nothing stale).
    assert main(["train", "--resume", str(out), "--max-steps", str(max(losses(out)) + 1)]) == 0


# -- signals ------------------------------------------------------------------------------------------

@pytest.mark.slow  # real processes
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_checkpoints_at_step_boundary_and_resumes_exactly(corpus, tmp_path, sig, code):
    out = tmp_path / "r"
    proc = spawn_training(corpus, out, "--max-steps", "100000", "--train.ckpt_interval", "0")
    wait_for_steps(proc, out, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(rf"txl train: stopped by {sig.name} at step (\d+); checkpoint (\S+) written\. "
                         rf"Resume with: txl train --resume {re.escape(str(out))}", last)
    assert match, last
    step = int(match.group(1))
    assert Path(match.group(2)) == out / "checkpoints" / f"step_{step:08d}"
    assert strict_json(out / "latest.json")["step"] == step == max(losses(out))
    assert main(["train", "--resume", str(out), "--max-steps", str(step + 2)]) == 0
    assert main(["train", *args(corpus, tmp_path / "straight", "--max-steps", str(step + 2))]) == 0
    assert losses(out) == losses(tmp_path / "straight")  # exact continuation, every float equal


@pytest.mark.slow  # real training
def test_forced_interrupt_without_checkpoint_prints_no_resume_command(corpus, tmp_path, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt  # a second Ctrl-C during the first step: no checkpoint exists

    monkeypatch.setattr(txl.train, "train_step", interrupted)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "5")]) == 130
    assert capsys.readouterr().err == (f"txl train: interrupted by SIGINT; no checkpoint was written, nothing to "
                                       f"resume; start again with --out {out} --overwrite\n")


# -- divergence ---------------------------------------------------------------------------------------

@pytest.mark.slow  # real training
def test_nan_validation_loss_is_never_checkpointed(corpus, tmp_path, monkeypatch, capsys):
    real = txl.train.evaluate
    calls = {"n": 0}

    def nan_on_second(*a, **k):
        calls["n"] += 1
        result = real(*a, **k)
        return EvalResult(float("nan"), result.tokens, result.seconds, result.metric) if calls["n"] == 2 else result

    monkeypatch.setattr(txl.train, "evaluate", nan_on_second)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "8", "--train.eval_interval", "2",
                                "--train.ckpt_interval", "0")]) == 1
    err = capsys.readouterr().err
    assert err == (f"txl train: error: the validation loss is nan at step 4: training diverged and this step "
                   f"was not saved. The last good checkpoint is {out / 'checkpoints' / 'step_00000002'}. Lower "
                   "--optim.lr, add --optim.warmup_steps, or use --train.precision fp32, then resume from it or "
                   "restart\n")
    assert strict_json(out / "latest.json") == strict_json(out / "best.json")
    assert strict_json(out / "latest.json")["step"] == 2
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]


@pytest.mark.slow  # real training
def test_non_finite_weights_are_never_checkpointed(corpus, tmp_path, monkeypatch, capsys):
    real = txl.train.train_step
    calls = {"n": 0}

    def poison_step_4(model, *a, **k):
        calls["n"] += 1
        stats, memories = real(model, *a, **k)
        if calls["n"] == 4:
            with torch.no_grad():
                next(model.parameters())[0] = float("inf")  # the loss was finite; the update was not
        return stats, memories

    monkeypatch.setattr(txl.train, "train_step", poison_step_4)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "9", "--train.ckpt_interval", "2")]) == 1
    err = capsys.readouterr().err
    assert "the weights hold non-finite values at step 4: training diverged and this step was not saved. " \
           f"The last good checkpoint is {out / 'checkpoints' / 'step_00000002'}." in err
    assert strict_json(out / "latest.json")["step"] == 2
    assert all(torch.isfinite(p).all() for p in txl.checkpoint.load_checkpoint(out).model.parameters())


# -- full disk, durability ----------------------------------------------------------------------------


@pytest.mark.slow  # real training
@pytest.mark.parametrize("writer", ["_write_state", "save_pretrained"])  # torch.save, safetensors
def test_failed_checkpoint_write_is_one_line(corpus, tmp_path, monkeypatch, capsys, file_size_limit, writer):
    real = getattr(txl.checkpoint, writer)
    calls = []

    def too_big_on_second_checkpoint(*a):
        calls.append(1)
        file_size_limit(1000 if len(calls) == 2 else None)  # the 2nd checkpoint, step 6
        try:
            return real(*a)
        finally:
            file_size_limit(None)

    monkeypatch.setattr(txl.checkpoint, writer, too_big_on_second_checkpoint)
    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "8")]) == 1
    err = capsys.readouterr().err
    assert err == (f"txl train: error: could not write checkpoint step 6 to {out / 'checkpoints' / 'step_00000006'} "
                   f"(File too large); the previous checkpoint {out / 'checkpoints' / 'step_00000003'} is intact. "
                   f"Free disk space and resume with: txl train --resume {out}\n")
    assert txl.checkpoint.load_checkpoint(out).path.name == "step_00000003"
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_safetensors_disk_full_message_is_named():
    from safetensors import SafetensorError

    err = SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                          '"No space left on device" })')
    assert txl.checkpoint._write_error(err) == "No space left on device"
    assert txl.checkpoint._write_error(SafetensorError("I/O error: No space left on device (os error 28)")) == \
        "No space left on device"


@pytest.mark.slow  # real training
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_every_file_has_the_umask_mode(corpus, tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        out = tmp_path / "r"
        assert main(["train", *args(corpus, out, "--max-steps", "3")]) == 0
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert "checkpoints/step_00000003/model.safetensors" in modes and "latest.json" in modes
    assert modes == dict.fromkeys(modes, mode)


@pytest.mark.slow  # real training
def test_files_are_fsynced_before_and_after_rename(corpus, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("rename", str(src), str(dst)))
        return real_replace(src, dst, **kw)

    out = tmp_path / "r"
    assert main(["train", *args(corpus, out, "--max-steps", "2")]) == 0  # warm the token cache
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "s"
    assert main(["train", *args(corpus, out, "--max-steps", "3")]) == 0
    monkeypatch.undo()
    ckpts = str(out / "checkpoints")
    final = f"{ckpts}/step_00000003"
    move = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == final)
    tmp = events[move][1]
    synced = {e[1] for e in events[:move] if e[0] == "fsync"}
    for name in ("model.safetensors", "config.json", "run.json", "train_state.pt", "tokenizer"):
        assert f"{tmp}/{name}" in synced, name  # the data, before the rename that publishes it
    assert tmp in synced and ("fsync", ckpts) in events[move:]  # the directory entry, after it
    latest = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out / "latest.json"))
    assert events[latest - 1] == ("fsync", events[latest][1]) and events[latest + 1] == ("fsync", str(out))


# -- kill -9 ------------------------------------------------------------------------------------------

@pytest.mark.slow  # real processes
def test_kill_9_at_random_moments_resumes_to_identical_weights(corpus, tmp_path):
    """Ten kills at random moments (a checkpoint every step, so several land mid-write); the resumed
    runs end with the uninterrupted run's weights, byte for byte, and the same loss at every step."""
    steps = 60
    straight, out = tmp_path / "straight", tmp_path / "killed"
    assert main(["train", *args(corpus, straight, "--max-steps", str(steps), "--train.ckpt_interval", "0")]) == 0
    rng = random.Random(0)
    mid_write = 0
    for _ in range(10):
        resume = (out / "latest.json").is_file()
        done = len(losses(out)) if (out / "metrics.jsonl").is_file() else 0
        proc = spawn_training(corpus, out, *([] if resume else ["--max-steps", str(steps), "--train.ckpt_interval",
                                                                "1", "--overwrite"]), resume=resume)
        wait_for_steps(proc, out, min(done + 1, steps))
        time.sleep(rng.uniform(0.0, 0.2))
        proc.kill()
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL, "the run finished before it was killed: raise steps"
        partial = list((out / "checkpoints").glob(".tmp-*")) + list(out.glob(".*.tmp"))
        mid_write += bool(partial)  # killed while a checkpoint or pointer was being written
    assert mid_write >= 1  # a checkpoint every step: most kills land in one
    assert main(["train", "--resume", str(out)]) == 0
    a = txl.rundir.find_checkpoint(straight)
    b = txl.rundir.find_checkpoint(out)
    assert a.name == b.name == f"step_{steps:08d}"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert losses(out) == losses(straight)
