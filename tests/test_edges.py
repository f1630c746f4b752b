"""Recovery at the edges (issue 27): every file a command writes, every signal, every output path.

In-process runs of ``txl.cli.main`` with an injected fault (a real EFBIG through the real writer where
the fault is a full disk, a monkeypatched writer raising ENOSPC where a thread or a library writes), and
real subprocesses with real signals where the fault is a signal (``slow``).
"""

import errno
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

import txl
import txl.data.corpora
import txl.fileio
import txl.metrics
import txl.train
from txl.cli import main

TINY = ["--preset", "tiny", "--model.n_layer", "1", "--model.d_model", "32", "--model.n_head", "2",
        "--model.d_head", "16", "--model.d_inner", "64", "--model.mem_len", "8", "--train.tgt_len", "8",
        "--train.batch_size", "4", "--train.log_interval", "1", "--train.progress", "false",
        "--train.tensorboard", "false", "--train.plot", "false", "--eval.batch_size", "2",
        "--eval.mem_len", "16", "--train.eval_batches", "2", "--train.eval_interval", "0",
        "--train.ckpt_interval", "3", "--train.sample_tokens", "0", "--model.dropout", "0",
        "--optim.schedule", "constant", "--optim.warmup_steps", "0", "--data.level", "byte"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: threads only contend on a shared CPU."""


def args(corpus, out, *more):
    return ["train", *TINY, "--data.corpus", corpus, "--out", str(out), *more]


def rows(out):
    return [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def error_lines(err):
    return [line for line in err.splitlines() if "error:" in line or "interrupted" in line]


# -- 1. metrics.jsonl, TensorBoard, the plot -----------------------------------------------------------

def test_append_cut_by_a_full_disk_leaves_no_partial_row(tmp_path, file_size_limit):
    path = tmp_path / "m.jsonl"
    txl.fileio.append_jsonl(path, {"kind": "train", "step": 1})
    before = path.read_bytes()
    file_size_limit(len(before) + 5)  # the next row is longer: the kernel takes 5 bytes, then EFBIG
    try:
        with pytest.raises(txl.fileio.WriteError, match=rf"could not write {path} \(File too large\)"):
            txl.fileio.append_jsonl(path, {"kind": "train", "step": 2, "loss": 1.5})
    finally:
        file_size_limit(None)
    assert path.read_bytes() == before  # cut back to the last whole row


def test_torn_last_row_is_dropped_and_reported_a_bad_middle_row_is_refused(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr')
    found, torn = txl.fileio.read_jsonl(path)
    assert found == [{"kind": "train", "step": 1}]
    assert torn == f"{path} ended in a torn row (line 2, 12 bytes, cut by a crash or a full disk)"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr\n{"kind": "train", "step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path} line 2 is not a JSON object .*the file is damaged"):
        txl.fileio.read_jsonl(path)


@pytest.mark.slow  # real training, twice (11 s loaded)
def test_resume_after_a_torn_row_drops_it_and_says_so(corpus, tmp_path, caplog):
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "3")) == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 4, "lo')  # what a kill or a full disk mid-append leaves
    assert main(["train", "--resume", str(out), "--max-steps", "5"]) == 0
    assert f"{out / 'metrics.jsonl'} ended in a torn row" in caplog.text and "dropped it" in caplog.text
    assert [r["step"] for r in rows(out) if r["kind"] == "train"] == [1, 2, 3, 4, 5]


def test_resume_rewrite_cut_by_a_full_disk_keeps_the_history(corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "4", "--train.ckpt_interval", "2")) == 0
    before = (out / "metrics.jsonl").read_bytes()
    (out / "latest.json").write_text(json.dumps({"step": 2, "path": "checkpoints/step_00000002"}))
    real = Path.write_text

    def disk_full(self, *a, **k):
        if self.name.startswith(".tmp-metrics.jsonl"):
            real(self, "{\"kind\": \"tr", encoding="utf-8")  # part of it reached the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", disk_full)
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (f"txl train: error: could not write {out / 'metrics.jsonl'} (No space left on device); the last "
                   f"checkpoint is {out / 'checkpoints' / 'step_00000002'}; resume with: txl train --resume {out}\n")
    assert (out / "metrics.jsonl").read_bytes() == before  # the history is whole, not truncated in place
    assert not list(out.glob(".tmp-*"))


def test_full_disk_during_a_metrics_append_is_one_line_and_resumes(corpus, tmp_path, monkeypatch, capsys,
                                                                    file_size_limit):
    real = txl.metrics.append_jsonl
    calls = []

    def efbig_on_fifth_row(path, row):
        calls.append(row)
        file_size_limit(path.stat().st_size + 10 if len(calls) == 5 else None)  # step 5's train row
        try:
            return real(path, row)
        finally:
            file_size_limit(None)

    monkeypatch.setattr(txl.metrics, "append_jsonl", efbig_on_fifth_row)
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "8")) == 1
    err = capsys.readouterr().err
    assert err == (f"txl train: error: could not write {out / 'metrics.jsonl'} (File too large); the last checkpoint "
                   f"is {out / 'checkpoints' / 'step_00000003'}; resume with: txl train --resume {out}\n")
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]  # every line whole
    monkeypatch.undo()
    assert main(["train", "--resume", str(out)]) == 0
    assert [r["step"] for r in rows(out) if r["kind"] == "train"] == list(range(1, 9))


def test_tensorboard_thread_failure_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    real, records = record_writer.RecordWriter.write, []

    def disk_full_from_the_20th_record(self, data):  # 1 event at start, then 5 scalars a step: step 4 on
        records.append(1)
        if len(records) >= 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", disk_full_from_the_20th_record)  # in its thread
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "8", "--train.tensorboard", "true")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert len(error_lines(err)) == 1 and err.rstrip().splitlines()[-1] == error_lines(err)[0]
    assert err.startswith(f"txl train: error: could not write {out / 'tb'} (No space left on device); the last "
                          "checkpoint is ")
    assert (out / "latest.json").is_file() and json.loads((out / "latest.json").read_text())["step"] >= 3


def test_tensorboard_failing_at_its_first_event_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    def disk_full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", disk_full)
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "4", "--train.tensorboard", "true")) == 1
    assert capsys.readouterr().err == (f"txl train: error: could not write {out / 'tb'} (No space left on device); "
                                       f"no checkpoint was written, nothing to resume; start again with --out {out} "
                                       "--overwrite\n")


@pytest.mark.slow  # real training (10 s loaded)
def test_failed_plot_is_a_warning_and_leaves_no_empty_png(corpus, tmp_path, monkeypatch, capsys, caplog):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def disk_full(self, fname, **kw):
        Path(fname).write_bytes(b"")  # what a full disk leaves: an empty file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "3", "--train.plot", "true")) == 0
    assert "trained 3 steps" in capsys.readouterr().out  # the summary of the finished run
    assert f"learning-curve plot not written: could not write {out / 'learning_curve.png'} (No space left on " \
           "device)" in caplog.text
    assert not (out / "learning_curve.png").exists() and not list(out.glob(".tmp-*"))


def test_plot_is_written_atomically(corpus, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "2", "--train.plot", "true")) == 0
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_are_skipped_with_one_line(tmp_path, monkeypatch, caplog):
    from txl.metrics import plot_learning_curve, plot_memory_sweep

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with caplog.at_level("INFO", logger="txl.metrics"):
        assert plot_learning_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png", "bpc") is False
        assert plot_memory_sweep([8, 16], [2.0, 1.9], "bpc", "16", tmp_path / "sweep.png") is False
    assert "matplotlib is not installed (pip install 'txl[cli]'): no learning-curve plot" in caplog.text
    assert "matplotlib is not installed (pip install 'txl[cli]'): no sweep plot" in caplog.text
    assert list(tmp_path.iterdir()) == []


# -- 2. contradictory config ----------------------------------------------------------------------------

def test_model_config_refuses_same_length_without_memory():
    with pytest.raises(ValueError, match="same_length with mem_len=0 masks every key"):
        tiny_config(mem_len=0, same_length=True)
    tiny_config(mem_len=1, same_length=True)  # a memory of 1 is fine


def test_matching_explicit_vocab_size_is_accepted(corpus, tmp_path):
    assert main(args(corpus, tmp_path / "r", "--max-steps", "1", "--model.vocab_size", "256")) == 0


# -- 3. signals (in process) ----------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["before torch.save", "inside torch.save"])
def test_second_ctrl_c_during_a_checkpoint_write_is_an_interruption(corpus, tmp_path, monkeypatch, capsys, where):
    calls = []

    def ctrl_c_twice_at_the_second_checkpoint():
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint (step 6): the user presses Ctrl-C twice
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    if where == "before torch.save":
        real = txl.checkpoint._write_state

        def write_state(path, state):
            ctrl_c_twice_at_the_second_checkpoint()
            return real(path, state)

        monkeypatch.setattr(txl.checkpoint, "_write_state", write_state)
    else:  # raised in the file's write, which torch.save calls from C++ (it reports its own RuntimeError)
        real_write = txl.checkpoint._KeepWriteError.write
        first = []

        def write(self, data):
            if not first:
                first.append(1)
                ctrl_c_twice_at_the_second_checkpoint()
            return real_write(self, data)

        real_state = txl.checkpoint._write_state

        def write_state(path, state):
            first.clear()
            return real_state(path, state)

        monkeypatch.setattr(txl.checkpoint._KeepWriteError, "write", write)
        monkeypatch.setattr(txl.checkpoint, "_write_state", write_state)
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "9")) == 130
    err = capsys.readouterr().err
    assert err == (f"txl train: interrupted by SIGINT during the write of checkpoint step 6; the last checkpoint is "
                   f"{out / 'checkpoints' / 'step_00000003'}; resume with: txl train --resume {out}\n")
    assert "disk" not in err
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("command", ["generate", "score"])
def test_ctrl_c_in_any_command_is_one_line_rc_130(corpus, tmp_path, monkeypatch, capsys, command):
    import txl.cli.generate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(txl.cli.generate, "load_model_and_tokenizer", interrupted)
    argv = ["generate", "--checkpoint", "x", "--prompt", "hi"] if command == "generate" else \
        ["score", "--checkpoint", "x", corpus]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"txl {command}: interrupted by SIGINT; ") and len(err.splitlines()) == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("after", [0, 4])
def test_an_interrupted_generate_says_whether_it_generated_anything(tmp_path, monkeypatch, capsys, sig, after):
    """Interrupted before its first token, `txl generate` says nothing was generated (it said "the text above is all
    that was generated" above no text, issue 44); after some, that the text above is all, on a line of its own."""
    from serve_util import make_model_dir

    import txl.generation
    from txl.signals import Interrupted

    real = txl.generation.generate_stream

    def cut(*a, **k):
        for i, token in enumerate(real(*a, **k)):
            if i == after:
                raise Interrupted(sig)
            yield token

    monkeypatch.setattr(txl.generation, "generate_stream", cut)
    directory = make_model_dir(tmp_path / "char")
    argv = ["generate", "--checkpoint", str(directory), "--prompt", "The cat", "--max-new-tokens", "9", "--seed", "1"]
    assert main(argv) == 128 + int(sig)
    out, err = capsys.readouterr()
    intact = "the text above is all that was generated" if after else "nothing was generated"
    assert err == f"txl generate: interrupted by {sig.name}; {intact}; nothing was written\n"
    assert (out.strip() != "" and out.endswith("\n")) if after else out == ""


def test_resume_command_under_torchrun(monkeypatch):
    from txl.signals import Stopped, resume_command

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resume_command("runs/x") == "txl train --resume runs/x"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command("runs/x") == "torchrun --nproc_per_node 2 -m txl train --resume runs/x"
    assert str(Stopped(signal.SIGTERM, 4, "c", "runs/x")).endswith(
        "Resume with: torchrun --nproc_per_node 2 -m txl train --resume runs/x")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resume_command("r") == ("torchrun --nproc_per_node 4 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint "
                                   "HOST:PORT -m txl train --resume r")


# -- 4. output files --------------------------------------------------------------------------------------

@pytest.fixture
def trained(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(args(corpus, out, "--max-steps", "2")) == 0
    return out


def test_score_output_on_a_full_disk_is_one_line_and_keeps_the_old_file(trained, corpus, tmp_path, capsys,
                                                                        file_size_limit, monkeypatch):
    out = tmp_path / "scores.jsonl"
    out.write_text("earlier\n")
    real = txl.fileio.atomic_write

    def limited(path, write, **kw):
        file_size_limit(200)
        try:
            return real(path, write, **kw)
        finally:
            file_size_limit(None)

    monkeypatch.setattr(txl.fileio, "atomic_write", limited)
    capsys.readouterr()
    assert main(["score", "--checkpoint", str(trained), corpus, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"txl score: error: could not write {out} (File too large); nothing was "
                                    "written there")
    assert out.read_text() == "earlier\n" and not list(tmp_path.glob(".tmp-*"))


def test_export_missing_parent_is_refused_not_created(trained, tmp_path, capsys):
    target = tmp_path / "nope" / "x.pt2"
    assert main(["export", "--checkpoint", str(trained), "-o", str(target)]) == 2
    assert not target.parent.exists()
    assert capsys.readouterr().err == (f"txl export: error: -o {target}: the directory {target.parent} does not "
                                       "exist; create it first\n")


@pytest.mark.slow  # torch.export (11 s loaded)
def test_export_write_failure_is_one_line(trained, tmp_path, capsys, monkeypatch):
    import txl.export

    def disk_full(program, f):
        f.write(b"PK")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(txl.export.torch.export, "save", disk_full)
    target = tmp_path / "x.pt2"
    assert main(["export", "--checkpoint", str(trained), "-o", str(target)]) == 1
    assert capsys.readouterr().err == (f"txl export: error: could not write {target} (No space left on device); "
                                       "nothing was written there\n")
    assert not target.exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output_directory_is_refused(trained, corpus, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for argv in (["score", "--checkpoint", str(trained), corpus, "-o", str(ro / "s.jsonl")],
                     ["export", "--checkpoint", str(trained), "-o", str(ro / "s.pt2")]):
            assert main(argv) == 2
            assert "is not writable (permission denied)" in capsys.readouterr().err
    finally:
        ro.chmod(0o755)


def test_eval_plot_on_a_full_disk_is_one_line(trained, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def disk_full(self, fname, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    plot = tmp_path / "sweep.png"
    assert main(["eval", str(trained), "--sweep-mem", "0,4", "--plot", str(plot), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"txl eval: error: could not write {plot} (No space left on device); nothing was "
                                    "written there")
    assert not plot.exists()


# -- 7. honest figures -------------------------------------------------------------------------------------

def test_empty_document_says_0_tokens_and_has_no_figure(trained, corpus, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "s.jsonl"
    assert main(["score", "--checkpoint", str(trained), str(empty), corpus, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{empty}: 0 tokens (empty after tokenisation; not scored)" in err and "nan" not in err
    totals = [r for r in map(json.loads, out.read_text().splitlines()) if "tokens" in r]
    assert totals[0] == {"doc": str(empty), "tokens": 0, "nll": 0.0, "bpc": None, "bits_per_token": None}
    assert totals[1]["tokens"] > 0 and totals[1]["bpc"] > 0


# -- 8. archives --------------------------------------------------------------------------------------------

def test_refused_tar_extracts_nothing(tmp_path):
    from txl.data.download import extract

    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as t:
        for name in ("data/one.txt", "data/two.txt"):
            member = tarfile.TarInfo(name)
            member.size = 2
            t.addfile(member, io.BytesIO(b"ok"))
        bad = tarfile.TarInfo("data/evil")
        bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(bad)
    into = tmp_path / "into"
    with pytest.raises(ValueError, match="archive member 'data/evil' .* is unsafe"):
        extract(archive, into)
    assert list(into.rglob("*")) == []


def test_tar_without_the_data_filter(tmp_path, monkeypatch):
    """Pythons before 3.10.12 / 3.11.4 (Debian 12's 3.11.2) lack tarfile.data_filter: plain files and directories
    still extract (no owner or setuid mode from the archive), and a link is refused, extracting nothing."""
    from txl.data.download import extract

    good, bad = tmp_path / "good.tar", tmp_path / "bad.tar"
    with tarfile.open(good, "w") as t:
        folder = tarfile.TarInfo("data")
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        t.addfile(folder)
        member = tarfile.TarInfo("data/train.txt")
        member.size, member.mode, member.uid, member.uname = 3, 0o4777, 12345, "nobody-here"
        t.addfile(member, io.BytesIO(b"a b"))
    with tarfile.open(bad, "w") as t:
        member = tarfile.TarInfo("data/one.txt")
        member.size = 2
        t.addfile(member, io.BytesIO(b"ok"))
        link = tarfile.TarInfo("data/inside")
        link.type, link.linkname = tarfile.SYMTYPE, "one.txt"  # harmless, but this Python cannot tell
        t.addfile(link)
    monkeypatch.delattr(tarfile, "data_filter")
    assert extract(good, tmp_path / "good") == ["data", "data/train.txt"]
    written = tmp_path / "good" / "data" / "train.txt"
    assert written.read_bytes() == b"a b"
    assert not written.stat().st_mode & 0o6000 and written.stat().st_uid == os.getuid()
    with pytest.raises(ValueError, match=r"'data/inside' .* is unsafe \(a link or special file, which this Python "
                                         r"[\d.]+ cannot check: it lacks tarfile's 'data' filter\)"):
        extract(bad, tmp_path / "bad")
    assert list((tmp_path / "bad").rglob("*")) == []


def test_unverified_archive_is_capped(tmp_path):
    from txl.data.download import UNVERIFIED_RATIO, extract

    archive = tmp_path / "zeros.tgz"
    with tarfile.open(archive, "w:gz") as t:  # 3 MB of zeros in a few KB
        member = tarfile.TarInfo("zeros.bin")
        member.size = 3 * 2**20
        t.addfile(member, io.BytesIO(bytes(member.size)))
    size = archive.stat().st_size
    into = tmp_path / "into"
    with pytest.raises(ValueError, match=rf"would unpack to 3,145,728 bytes, more than the {UNVERIFIED_RATIO * size:,} "
                                         "allowed for an archive no checksum vouches for"):
        extract(archive, into, max_bytes=UNVERIFIED_RATIO * size)
    assert list(into.iterdir()) == []
    assert extract(archive, tmp_path / "trusted") == ["zeros.bin"]  # a checksummed archive is not capped


def test_download_corpus_caps_an_archive_without_checksum(tmp_path):
    from txl.data.corpora import REGISTRY, download_corpus

    spec = REGISTRY["ptb"]
    assert spec.downloads[0].sha256 is None  # simple-examples.tgz: no published checksum
    d = tmp_path / "ptb"
    d.mkdir()
    with tarfile.open(d / spec.downloads[0].filename, "w:gz") as t:
        member = tarfile.TarInfo("simple-examples/data/ptb.train.txt")
        member.size = 2**22
        t.addfile(member, io.BytesIO(bytes(member.size)))
    with pytest.raises(ValueError, match="would unpack to 4,194,304 bytes"):
        download_corpus("ptb", d)
    assert not (d / "simple-examples").exists()


# -- 9. bounds ------------------------------------------------------------------------------------------------

def _generation_module():
    import importlib

    return importlib.import_module(txl.generate.__module__)  # txl.generate is the function


def test_whole_context_generation_beyond_free_memory_is_refused(monkeypatch):
    gen = _generation_module()
    model = txl.TransformerXL(tiny_config())
    free = gen.context_bytes(model.config, 1, 100)  # room for 100 positions: the fitting run below is short
    monkeypatch.setattr(gen, "available_bytes", lambda device: free)
    with pytest.raises(ValueError, match=r"max_new_tokens=100,000,000 with the whole context kept \(mem_len none\) "
                                         r"would hold 100,000,003 positions of memory"):
        gen.generate(model, [1, 2, 3], max_new_tokens=100_000_000)
    # A memory length bounds it whatever the number of tokens (the state holds mem_len positions).
    assert gen.generate(model, [1, 2, 3], max_new_tokens=5, mem_len=8, seed=0).shape == (1, 5)
    assert gen.generate(model, [1, 2, 3], max_new_tokens=90, seed=0).shape == (1, 90)  # it fits


def test_context_bytes_counts_memory_and_key_value_cache():
    c = tiny_config(n_layer=3)  # 3 layers, a batch of 2: a count that mixed them up would differ
    # per position and layer: the memory's d_model floats, the cached key and value's n_head * d_head each
    assert _generation_module().context_bytes(c, 2, 10) == 2 * 10 * 3 * (32 + 2 * 4 * 8) * 4


# -- 10. advice that fits ---------------------------------------------------------------------------------------

def test_poisoned_token_cache_names_the_entry_and_the_fix(corpus, tmp_path, capsys):
    assert main(["data", "prepare", corpus, "--data.level", "byte"]) == 0
    entry = next(p for p in (tmp_path / "cache" / "txl" / "tokens").iterdir() if (p / "meta.json").is_file())
    np.save(entry / "train.npy", np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    capsys.readouterr()
    assert main(["data", "prepare", corpus, "--data.level", "byte"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"txl data: error: the token cache entry {entry} is damaged (ValueError: ")
    assert err.endswith(f"delete that entry (rm -r {entry}) and run again: it is rebuilt from the corpus\n")
    np.save(entry / "train.npy", np.zeros(3, dtype=np.int64))  # right shape, wrong dtype and count
    assert main(["data", "prepare", corpus, "--data.level", "byte"]) == 2
    assert f"the token cache entry {entry} is damaged" in capsys.readouterr().err


def test_divergence_before_any_checkpoint_says_there_is_nothing_to_resume(corpus, tmp_path, monkeypatch, capsys):
    real = txl.train.train_step

    def nan_loss(*a, **k):
        stats, memories = real(*a, **k)
        return txl.train.StepStats(float("nan"), stats.tokens, stats.lr, stats.grad_norm), memories

    monkeypatch.setattr(txl.train, "train_step", nan_loss)
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "5")) == 1
    assert capsys.readouterr().err == (
        "txl train: error: loss is nan at step 1: training stopped. No checkpoint was written yet, so there is "
        "nothing to resume: lower --optim.lr, add --optim.warmup_steps, or use --train.precision fp32, and start "
        "again with the same command and --overwrite\n")


def test_resume_of_a_finished_run_writes_each_final_row_once(corpus, tmp_path, caplog):
    """...and says the run had finished (it only evaluates again)."""
    out = tmp_path / "r"
    assert main(args(corpus, out, "--max-steps", "4")) == 0
    before = rows(out)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txl"):
        assert main(["train", "--resume", str(out)]) == 0
    assert "the run had finished (step 4 of 4): nothing to train" in caplog.text
    after = rows(out)
    kinds = [r["kind"] for r in after]
    assert kinds.count("test") == 1 and kinds.count("valid_full") == 1 and kinds.count("valid") == 1
    progress = [r for r in before if r["kind"] in ("train", "valid")]
    assert [r for r in after if r["kind"] in ("train", "valid")] == progress
    assert [r["loss"] for r in after if r["kind"] == "test"] == [r["loss"] for r in before if r["kind"] == "test"]


def test_older_run_json_without_later_fields_still_loads(trained, capsys):
    ckpt = txl.checkpoint.find_checkpoint(trained)
    data = json.loads((ckpt / "run.json").read_text())
    for section, name in (("train", "compile"), ("train", "loss_positions"), ("eval", "compile")):
        data[section].pop(name)
    data.pop("sample"), data.pop("compute")
    (ckpt / "run.json").write_text(json.dumps(data))
    run = txl.checkpoint.read_run(ckpt)  # the documented older version: later fields take their defaults
    assert (run.compute.attn_impl, run.train.loss_positions, run.train.compile) == ("fused", "all", False)
    assert main(["eval", str(trained), "--no-progress"]) == 0


# -- 3. signals (real processes) ------------------------------------------------------------------------------

def _spawn(script, tmp_path):
    """A real `python -c` process running ``script`` (which patches a stage to print READY and wait, then calls
    txl.cli.main), one thread, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(txl.__file__).parents[1]),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # SIGINT as a terminal delivers it: a shell without job control starts background jobs with SIGINT
    # ignored, and Python then never installs its KeyboardInterrupt handler (a real Ctrl-C would not be ignored).
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_ready(proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == "READY":
            return
        assert line or proc.poll() is None, proc.communicate()[1][-2000:]
    proc.kill()
    raise AssertionError("the stage was not reached")


WAIT_AT = """
import importlib, sys, time
target = importlib.import_module("{module}")
real = target.{name}
def wait(*a, **k):
    print("READY", flush=True)
    time.sleep(60)
    return real(*a, **k)
target.{name} = wait
from txl.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.slow  # real processes
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_the_final_evaluation_is_reported_and_resumes_once(corpus, tmp_path, sig, code):
    out = tmp_path / "r"
    proc = _spawn(WAIT_AT.format(module="txl.train", name="Trainer.test", argv=args(corpus, out, "--max-steps", "4")),
                  tmp_path)
    _wait_ready(proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"txl train: interrupted by {sig.name} during the final evaluation (training is complete; resuming runs "
        f"the evaluation again); the last checkpoint is {out / 'checkpoints' / 'step_00000004'}; resume with: txl "
        f"train --resume {out}")
    assert main(["train", "--resume", str(out)]) == 0
    kinds = [r["kind"] for r in rows(out)]
    assert kinds.count("test") == 1 and kinds.count("valid_full") == 1 and kinds.count("valid") == 1


@pytest.mark.slow  # real processes
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.parametrize("stage", ["start-up", "generate"])
def test_signal_at_start_up_or_in_generate_is_one_line(corpus, tmp_path, trained, sig, code, stage):
    if stage == "start-up":
        script = WAIT_AT.format(module="txl.data.corpora", name="load_run_corpus",
                                argv=args(corpus, tmp_path / "fresh", "--max-steps", "2"))
        expected = f"txl train: interrupted by {sig.name}; nothing was written; run the same command again"
    else:
        script = WAIT_AT.format(module="txl.decoding", name="sample_next",  # where txl.generate draws a token
                                argv=["generate", "--checkpoint", str(trained), "--prompt", "def", "--max-new-tokens",
                                      "5"])
        expected = f"txl generate: interrupted by {sig.name}; nothing was generated; nothing was written"  # 1st token
    proc = _spawn(script, tmp_path)
    _wait_ready(proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == expected, err[-2000:]


@pytest.mark.slow  # real processes: torchrun with 2 workers
def test_ddp_stop_prints_the_torchrun_command_that_resumes(corpus, tmp_path):
    import socket

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(txl.__file__).parents[1]),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def torchrun(*argv):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), "-m", "txl", *argv]

    out = tmp_path / "r"
    proc = subprocess.Popen(torchrun(*args(corpus, out, "--max-steps", "100000", "--train.ckpt_interval", "0")),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # two workers importing torch on a busy 2-core machine
    while not ((out / "metrics.jsonl").is_file() and len(txl.fileio.read_jsonl(out / "metrics.jsonl")[0]) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the launcher's preemption notice, forwarded to both workers
    _, err = proc.communicate(timeout=300)
    stopped = [x for x in err.splitlines() if x.startswith("txl train: stopped by SIGTERM")]
    assert len(stopped) == 1, err[-3000:]  # rank 0 reports
    line = stopped[0]
    assert line.endswith(f"Resume with: torchrun --nproc_per_node 2 -m txl train --resume {out}"), line
    step = json.loads((out / "latest.json").read_text())["step"]
    # The advice works: the same process count resumes exactly (another count reshards, txl.train_state).
    done = subprocess.run(torchrun("train", "--resume", str(out), "--max-steps", str(step + 1)), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in rows(out) if r["kind"] == "train"][-1] == step + 1




@pytest.mark.parametrize("keys", ["mem_len + 1 .. mem_len + 512", "4 + mem_len + 1 .. 4 + mem_len + 512", "64"])
def test_the_sweep_plots_axis_labels_lie_inside_the_figure(keys, tmp_path, monkeypatch):
    """mem_sweep.png: the x-axis label, keys per query of a long segment included, is drawn inside the saved figure
    (one line cut it off, issue 44)."""
    pytest.importorskip("matplotlib")
    import txl.metrics

    extents = []

    def measure(fig, png):
        fig.canvas.draw()  # the labels are placed when drawn
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            for label in (ax.xaxis.label, ax.yaxis.label, ax.title):
                extents.append((label.get_text(), label.get_window_extent(renderer), fig.bbox))

    monkeypatch.setattr(txl.metrics, "_save_figure", measure)
    assert txl.metrics.plot_memory_sweep([0, 64, 512], [2.1, 2.0, 1.95], "bpc", keys, tmp_path / "sweep.png")
    assert any(keys in text for text, _, _ in extents)
    for text, box, figure in extents:
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 and box.y1 <= figure.y1, text
