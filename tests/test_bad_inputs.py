"""The bad-input table: every hostile or broken input to the `txl` command ends in one line that says what
is wrong and what to do, with a known exit code; never a traceback, never code execution.

Each row is (id, argv, expected message, exit code[, setup]). ``{name}`` in argv and message is a path of
the ``world`` fixture (a small trained run and broken copies of it, made once for the module). The
expected message is the whole stderr line after ``txl COMMAND: error: `` or, ending in ``...``, its
start; argparse's own errors are matched on their last line. Everything runs in this process
(``txl.cli.main``), so the table stays fast.
"""

import io
import json
import shutil
import tarfile
import urllib.error
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

import txl.data.download
from txl.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--preset", "tiny", "--model.n_layer", "1", "--model.d_model", "32", "--model.n_head", "2",
        "--model.d_head", "16", "--model.d_inner", "64", "--model.mem_len", "8", "--train.tgt_len", "8",
        "--train.batch_size", "4", "--train.progress", "false", "--train.tensorboard", "false",
        "--train.plot", "false", "--eval.batch_size", "2", "--train.eval_batches", "2",
        "--train.eval_interval", "0", "--train.sample_tokens", "0", "--data.level", "byte"]


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained tiny run, its checkpoint, broken copies of both, and files of every kind of wrong."""
    root = tmp_path_factory.mktemp("bad")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    text = root / "code.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    run = root / "run"
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert main(["train", *TINY, "--data.corpus", str(text), "--out", str(run), "--max-steps", "2"]) == 0
    torch.set_num_threads(threads)
    ckpt = run / "checkpoints" / "step_00000002"
    w = {"root": root, "run": run, "ckpt": ckpt, "text": text}

    def broken(name, edit):
        copy = root / name
        shutil.copytree(run, copy)
        edit(copy, copy / "checkpoints" / "step_00000002")
        w[name] = copy
        w[name + "_ckpt"] = copy / "checkpoints" / "step_00000002"

    broken("null_model", lambda r, c: _edit_json(c / "config.json", lambda d: d.update(model=None)))
    broken("abc_cutoffs", lambda r, c: _edit_json(c / "config.json", lambda d: d["model"].update(cutoffs="abc")))
    broken("bad_json", lambda r, c: (c / "config.json").write_text("{not json"))
    broken("no_config_format", lambda r, c: (c / "config.json").write_text('{"hello": 1}'))
    broken("truncated_weights", lambda r, c: (c / "model.safetensors").write_bytes(
        (c / "model.safetensors").read_bytes()[:60]))
    broken("no_weights", lambda r, c: (c / "model.safetensors").unlink())
    broken("corrupt_latest", lambda r, c: (r / "best.json").write_text("NaN{") or
           (r / "latest.json").write_text("NaN{"))
    broken("dangling_latest", lambda r, c: (r / "best.json").unlink() or shutil.rmtree(c))
    broken("no_run_json", lambda r, c: (c / "run.json").unlink())
    broken("bad_run_json", lambda r, c: (c / "run.json").write_text("[1, 2"))
    broken("truncated_state", lambda r, c: (c / "train_state.pt").write_bytes(
        (c / "train_state.pt").read_bytes()[:100]))
    broken("pickled_state", lambda r, c: torch.save({"step": 2, "evil": _Evil()}, c / "train_state.pt"))
    broken("other_vocab", lambda r, c: _edit_json(c / "tokenizer" / "tokenizer.json",
                                                  lambda d: d.update(vocab_size=7)))

    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("   \n\n")
    (root / "latin1.txt").write_bytes("caf\xe9 na\xefve\n".encode("latin-1"))
    (root / "a_dir").mkdir()
    (root / "preset.toml").write_text("[model\nn_layer = 2\n")
    (root / "junk.tar.gz").write_bytes(b"this is not an archive")
    with tarfile.open(root / "escape.tar", "w") as t:  # a symlink pointing out of the target directory
        link = tarfile.TarInfo("data/evil")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(link)
    with tarfile.open(root / "dotdot.tar", "w") as t:
        member = tarfile.TarInfo("../outside.txt")
        member.size = 2
        t.addfile(member, io.BytesIO(b"hi"))
    with zipfile.ZipFile(root / "escape.zip", "w") as z:
        z.writestr("../../outside.txt", "hi")
    hf = root / "hf_pickle"  # a Hugging Face-style directory whose only vocabulary is a pickle
    shutil.copytree(ckpt, hf)
    shutil.rmtree(hf / "tokenizer")
    (hf / "vocab.pkl").write_bytes(b"\x80\x04K\x01.")
    w["hf_pickle"] = hf
    pkl = root / "pickled_bin"  # legacy weights holding a pickled object: never unpickled
    pkl.mkdir()
    shutil.copy(ckpt / "config.json", pkl / "config.json")
    torch.save({"weight": _Evil()}, pkl / "pytorch_model.bin")
    w["pickled_bin"] = pkl
    yield {k: str(v) for k, v in w.items()}
    mp.undo()


class _Evil:
    """Unpickling this would call print: proof that a file's code ran (it must not)."""

    def __reduce__(self):
        return (print, ("pwned",))


def offline(monkeypatch):
    def refuse(*a, **k):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))
    monkeypatch.setattr(txl.data.download.urllib.request, "urlopen", refuse)


def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


T = "--preset tiny --data.corpus {text} --data.level byte --max-steps 1 --out {root}/fresh".split()
R = ["--checkpoint", "{run}"]

CASES = [
    # -- the command line itself
    ("no-such-command", ["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate' ...", 2),
    ("train-unknown-flag", ["train", "--bogus"], "unrecognised argument ...", 2),
    ("train-unknown-field", ["train", "--model.mem_lenn", "3"], "unknown field model.mem_lenn ...", 2),
    ("train-unknown-section", ["train", "--modle.mem_len", "3"], "unknown option --modle.mem_len ...", 2),
    ("train-flag-without-value", ["train", "--model.mem_len"], "--model.mem_len needs a value", 2),
    ("train-lr-not-number", ["train", "--optim.lr", "fast"], "optim.lr='fast' must be a number", 2),
    ("train-int-not-int", ["train", "--model.n_layer", "2.5"], "model.n_layer='2.5' must be an integer", 2),
    ("train-bool-not-bool", ["train", "--train.progress", "maybe"], "...", 2),
    ("train-literal", ["train", "--model.attn_type", "rotary"], "...", 2),
    ("train-cutoffs-abc", ["train", "--model.cutoffs", "abc"], "...", 2),
    ("train-cutoffs-bad-list", ["train", "--model.cutoffs", "[1, 2"], "...", 2),
    ("train-batch-not-divisible", ["train", "--train.batch_size", "10", "--train.grad_accum", "3"], "...", 2),
    ("train-n-head-zero", ["train", *T, "--model.n_head", "0"], "...", 2),
    ("train-negative-steps", ["train", "--max-steps", "-1"], "...", 2),
    ("train-max-steps-text", ["train", "--max-steps", "ten"], "...", 2),
    ("train-negative-minutes", ["train", "--minutes", "-1"], "...", 2),
    ("train-dropout-above-one", ["train", "--model.dropout", "1.5"], "...", 2),
    ("train-unknown-preset", ["train", "--preset", "huge"], "...", 2),
    ("train-missing-preset-file", ["train", "--preset", "{root}/nope.toml"], "...", 2),
    ("train-broken-toml", ["train", "--preset", "{root}/preset.toml"], "...", 2),
    ("train-fp16-on-cpu", ["train", "--train.precision", "fp16", "--train.device", "cpu"], "...", 2),
    ("train-device-tpu9", ["train", *T, "--train.device", "tpu9"], "...", 2),
    ("train-device-cuda", ["train", *T, "--train.device", "cuda"], "...", 2, no_cuda),
    ("train-missing-corpus", ["train", *T, "--data.corpus", "{root}/nope.txt"], "...", 2),
    ("train-empty-corpus", ["train", *T, "--data.corpus", "{root}/empty.txt"], "...", 2),
    ("train-latin1-corpus", ["train", *T, "--data.corpus", "{root}/latin1.txt", "--data.level", "char"], "...", 2),
    ("train-level-unknown", ["train", *T, "--data.level", "klingon"], "...", 2),
    ("train-tgt-len-beyond-valid", ["train", *T, "--train.tgt_len", "2000"], "...", 2),
    ("train-out-is-file", ["train", *T, "--out", "{text}"], "...", 2),
    ("train-used-run-dir", ["train", *T, "--out", "{run}"], "...", 2),
    ("train-resume-missing", ["train", "--resume", "{root}/nope"], "...", 2),
    ("train-resume-empty-dir", ["train", "--resume", "{root}/a_dir"], "...", 2),
    ("train-resume-with-preset", ["train", "--resume", "{run}", "--preset", "tiny"], "...", 2),
    ("train-resume-and-overwrite", ["train", "--resume", "{run}", "--overwrite"], "...", 2),
    ("train-resume-truncated-state", ["train", "--resume", "{truncated_state}"], "...", 2),
    ("train-resume-pickled-state", ["train", "--resume", "{pickled_state}"], "...", 2),
    ("train-resume-corrupt-run-json", ["train", "--resume", "{bad_run_json}"], "...", 2),
    ("train-resume-other-vocab", ["train", "--resume", "{other_vocab}"], "...", 2),
    # -- txl eval
    ("eval-missing", ["eval", "{root}/nope"], "...", 2),
    ("eval-not-a-run", ["eval", "{root}/a_dir"], "...", 2),
    ("eval-batch-size-0", ["eval", "{run}", "--batch-size", "0"], "...", 2),
    ("eval-batch-size-negative", ["eval", "{run}", "--batch-size", "-2"], "...", 2),
    ("eval-tgt-len-0", ["eval", "{run}", "--tgt-len", "0"], "...", 2),
    ("eval-mem-len-negative", ["eval", "{run}", "--mem-len", "-3"], "...", 2),
    ("eval-max-batches-negative", ["eval", "{run}", "--max-batches", "-1"], "...", 2),
    ("eval-sweep-not-ints", ["eval", "{run}", "--sweep-mem", "a,b"], "...", 2),
    ("eval-split-train", ["eval", "{run}", "--split", "train"], "argument --split: invalid choice ...", 2),
    ("eval-device-tpu9", ["eval", "{run}", "--device", "tpu9"], "...", 2),
    ("eval-device-cuda", ["eval", "{run}", "--device", "cuda"], "...", 2, no_cuda),
    ("eval-config-model-null", ["eval", "{null_model}"], "...", 2),
    ("eval-config-cutoffs-abc", ["eval", "{abc_cutoffs}"], "...", 2),
    ("eval-config-not-json", ["eval", "{bad_json}"], "...", 2),
    ("eval-config-no-format", ["eval", "{no_config_format}"], "...", 2),
    ("eval-truncated-weights", ["eval", "{truncated_weights}"], "...", 2),
    ("eval-no-weights", ["eval", "{no_weights}"], "...", 2),
    ("eval-corrupt-pointer", ["eval", "{corrupt_latest}"], "...", 2),
    ("eval-dangling-pointer", ["eval", "{dangling_latest}"], "...", 2),
    ("eval-no-run-json", ["eval", "{no_run_json}"], "...", 2),
    ("eval-other-corpus", ["eval", "{run}", "--corpus", "{root}/latin1.txt"], "...", 2),
    ("eval-ext-len-negative", ["eval", "{run}", "--ext-len", "-1"], "...", 2),
    # -- txl generate
    ("generate-no-prompt", ["generate", *R], "one of the arguments --prompt --prompt-file is required", 2),
    ("generate-empty-prompt", ["generate", *R, "--prompt", "  "], "...", 2),
    ("generate-prompt-file-missing", ["generate", *R, "--prompt-file", "{root}/nope.txt"], "...", 2),
    ("generate-prompt-file-dir", ["generate", *R, "--prompt-file", "{root}/a_dir"], "...", 2),
    ("generate-prompt-file-latin1", ["generate", *R, "--prompt-file", "{root}/latin1.txt"], "...", 2),
    ("generate-temperature-negative", ["generate", *R, "--prompt", "x", "--temperature", "-1"], "...", 2),
    ("generate-top-p-zero", ["generate", *R, "--prompt", "x", "--top-p", "0"], "...", 2),
    ("generate-top-p-above-one", ["generate", *R, "--prompt", "x", "--top-p", "1.5"], "...", 2),
    ("generate-top-k-negative", ["generate", *R, "--prompt", "x", "--top-k", "-1"], "...", 2),
    ("generate-max-new-tokens-negative", ["generate", *R, "--prompt", "x", "--max-new-tokens", "-1"], "...", 2),
    ("generate-segment-len-0", ["generate", *R, "--prompt", "x", "--segment-len", "0"], "...", 2),
    ("generate-mem-len-negative", ["generate", *R, "--prompt", "x", "--mem-len", "-1"], "...", 2),
    ("generate-device-tpu9", ["generate", *R, "--prompt", "x", "--device", "tpu9"], "...", 2),
    ("generate-device-cuda", ["generate", *R, "--prompt", "x", "--device", "cuda"], "...", 2, no_cuda),
    ("generate-checkpoint-missing", ["generate", "--checkpoint", "{root}/nope", "--prompt", "x"], "...", 2),
    ("generate-pickled-vocab", ["generate", "--checkpoint", "{hf_pickle}", "--prompt", "x"], "...", 2),
    ("generate-pickled-weights", ["generate", "--checkpoint", "{pickled_bin}", "--prompt", "x"], "...", 2),
    ("generate-vocab-missing", ["generate", *R, "--prompt", "x", "--vocab", "{root}/nope.txt"], "...", 2),
    # -- txl score
    ("score-file-missing", ["score", *R, "{root}/nope.txt"], "...", 2),
    ("score-file-is-dir", ["score", *R, "{root}/a_dir"], "...", 2),
    ("score-file-latin1", ["score", *R, "{root}/latin1.txt"], "...", 2),
    ("score-output-is-dir", ["score", *R, "{text}", "-o", "{root}/a_dir"], "...", 2),
    ("score-output-parent-missing", ["score", *R, "{text}", "-o", "{root}/nope/s.jsonl"], "...", 2),
    ("score-batch-size-0", ["score", *R, "{text}", "--batch-size", "0"], "...", 2),
    ("score-device-tpu9", ["score", *R, "{text}", "--device", "tpu9"], "...", 2),
    ("score-device-cuda", ["score", *R, "{text}", "--device", "cuda"], "...", 2, no_cuda),
    # -- txl data
    ("data-unknown-corpus", ["data", "download", "wikipedia"], "...", 2),
    ("data-download-offline", ["data", "download", "ptb", "--dir", "{root}/ptb"], "...", 1, offline),
    ("data-from-file-missing", ["data", "download", "ptb", "--dir", "{root}/ptb2", "--from-file",
                                "{root}/nope.tgz"], "...", 2),
    ("data-from-file-junk", ["data", "download", "ptb", "--dir", "{root}/ptb3", "--from-file",
                             "{root}/junk.tar.gz"], "...", 2),
    ("data-archive-link-escape", ["data", "download", "ptb", "--dir", "{root}/ptb4", "--from-file",
                                  "{root}/escape.tar"], "...", 2),
    ("data-archive-dotdot", ["data", "download", "ptb", "--dir", "{root}/ptb5", "--from-file",
                             "{root}/dotdot.tar"], "...", 2),
    ("data-archive-zip-escape", ["data", "download", "ptb", "--dir", "{root}/ptb6", "--from-file",
                                 "{root}/escape.zip"], "...", 2),
    ("data-from-file-wrong-archive", ["data", "download", "enwik8", "--dir", "{root}/e8", "--from-file",
                                      "{root}/escape.zip"], "...", 2),
    ("data-from-file-many-files", ["data", "download", "lm1b", "--dir", "{root}/lm", "--from-file",
                                   "{text}"], "...", 2),
    ("data-prepare-missing", ["data", "prepare", "{root}/nope.txt"], "...", 2),
    ("data-prepare-empty", ["data", "prepare", "{root}/blank.txt", "--level", "char"], "...", 2),
    ("data-prepare-level", ["data", "prepare", "{text}", "--level", "klingon"], "argument --level: invalid ...", 2),
]


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(world, case, monkeypatch, tmp_path):
    name, argv, expected, code = case[:4]
    if len(case) > 4:
        case[4](monkeypatch)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli([a.format(**world) for a in argv])
    assert "Traceback" not in err and "pwned" not in out + err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    print(f"@@ {name} rc={rc} :: {lines[-1] if lines else ''}")
    assert rc == code
