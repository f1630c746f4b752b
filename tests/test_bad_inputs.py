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
import socket
import tarfile
import urllib.error
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from conftest import ATTN_TYPES

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
    broken("other_vocab", lambda r, c: [_edit_json(f, lambda d: d.update(vocab_size=7))
                                        for f in (c / "tokenizer").glob("*.json") if '"vocab_size"' in f.read_text()])

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
    with zipfile.ZipFile(root / "link_then_file.zip", "w") as z:  # a symlink entry, then a file under it
        link = zipfile.ZipInfo("data")
        link.external_attr = (0o120777 << 16)  # S_IFLNK: zipfile would write it as a plain file
        z.writestr(link, "/tmp")
        z.writestr("data/x.txt", "hi")
    with tarfile.open(root / "good_then_bad.tar", "w") as t:  # a fine member, then an unsafe one
        good = tarfile.TarInfo("data/ok.txt")
        good.size = 2
        t.addfile(good, io.BytesIO(b"ok"))
        bad = tarfile.TarInfo("data/evil")
        bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(bad)
    broken("run_json_no_d_model", lambda r, c: _edit_json(c / "run.json", lambda d: d["model"].pop("d_model")))
    broken("run_json_no_eval_tgt", lambda r, c: _edit_json(c / "run.json", lambda d: d["eval"].pop("tgt_len")))
    hf = root / "hf_pickle"  # a Hugging Face-style directory whose only vocabulary is a pickle, of no vocabulary
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
        raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))
    monkeypatch.setattr(txl.data.download.urllib.request, "urlopen", refuse)


def no_temporary_directory(monkeypatch):
    """mkdtemp fails as it does under /proc (root may write there by os.access, nothing can be made): the error
    names the temporary it tried, which is no file of the user's (issue 44)."""
    import tempfile

    def refuse(prefix="", dir=None, **_):
        raise FileNotFoundError(2, "No such file or directory", f"{dir}/{prefix}p377zk7v")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)


def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


T = "--preset tiny --data.corpus {text} --data.level byte --max-steps 1 --out {root}/fresh".split()
R = ["--checkpoint", "{run}"]

CASES = [
    # -- the command line itself
    ("no-such-command", ["frobnicate"],
     "argument COMMAND: invalid choice: 'frobnicate' ...", 2),
    ("train-unknown-flag", ["train", "--bogus"],
     "unrecognised argument '--bogus'; config fields are set as --data.FIELD, --model.FIELD, --compute.FIELD, "
     "--optim.FIELD, --train.FIELD, --eval.FIELD, --sample.FIELD VALUE (see txl train --help)", 2),
    ("train-unknown-field", ["train", "--model.mem_lenn", "3"],
     "unknown field model.mem_lenn (did you mean mem_len?); valid model fields are: ...", 2),
    ("train-moved-field", ["train", "--model.attn_impl", "reference"],
     "unknown field model.attn_impl: it is compute.attn_impl now (--compute.attn_impl; how the model is computed, "
     "not what it is)", 2),
    ("train-unknown-section", ["train", "--modle.mem_len", "3"],
     "unrecognised argument '--modle.mem_len'; config fields are set as --data.FIELD, --model.FIELD, "
     "--compute.FIELD, --optim.FIELD, --train.FIELD, --eval.FIELD, --sample.FIELD VALUE (see txl train --help)", 2),
    ("train-flag-without-value", ["train", "--model.mem_len"],
     "argument --model.mem_len: expected one argument", 2),
    ("train-lr-not-number", ["train", "--optim.lr", "fast"],
     "optim.lr='fast' must be a number", 2),
    ("train-int-not-int", ["train", "--model.n_layer", "2.5"],
     "model.n_layer='2.5' must be an integer", 2),
    ("train-bool-not-bool", ["train", "--train.progress", "maybe"],
     "train.progress='maybe' must be a boolean (true or false)", 2),
    ("train-literal", ["train", "--model.attn_type", "nope"],
     f"model.attn_type='nope' is not allowed; choose one of {', '.join(map(repr, ATTN_TYPES))}", 2),
    ("train-cutoffs-abc", ["train", "--model.cutoffs", "abc"],
     "model.cutoffs='abc' must be an integer", 2),
    ("train-cutoffs-bad-list", ["train", "--model.cutoffs", "[1, 2"],
     "model.cutoffs='[1, 2' is not a list; write e.g. 1,2,3 or [1, 2, 3]", 2),
    ("train-batch-not-divisible", ["train", "--train.batch_size", "10", "--train.grad_accum", "3"],
     "train.batch_size=10 must be divisible by 1 process(es) x grad_accum=3 (each accumulation chunk of each "
     "process takes an equal share of the streams); use a multiple of 3", 2),
    ("train-n-head-zero", ["train", *T, "--model.n_head", "0"],
     "ModelConfig.n_head=0 must be a positive integer", 2),
    ("train-negative-steps", ["train", "--max-steps", "-1"],
     "TrainConfig.max_steps=-1 must be a positive integer", 2),
    ("train-max-steps-text", ["train", "--max-steps", "ten"],
     "argument --max-steps: invalid int value: 'ten'", 2),
    ("train-negative-minutes", ["train", "--minutes", "-1"],
     "TrainConfig.minutes=-1.0 must be >= 0", 2),
    ("train-dropout-above-one", ["train", "--model.dropout", "1.5"],
     "ModelConfig.dropout=1.5 must be in [0, 1)", 2),
    ("train-unknown-preset", ["train", "--preset", "huge"],
     "unknown preset 'huge'; presets are: default, ...", 2),
    ("train-missing-preset-file", ["train", "--preset", "{root}/nope.toml"],
     "config file {root}/nope.toml not found", 2),
    ("train-broken-toml", ["train", "--preset", "{root}/preset.toml"],
     "{root}/preset.toml is not valid TOML: ...", 2),
    ("train-fp16-on-cpu", ["train", "--train.precision", "fp16", "--train.device", "cpu"],
     "train.precision='fp16' needs CUDA (its gradient scaler is CUDA-only) and the run is on cpu; use "
     "--train.precision bf16 (or fp32) on CPU", 2),
    ("train-device-tpu9", ["train", *T, "--train.device", "tpu9"],
     "TrainConfig.device='tpu9' must be 'auto', 'cpu', 'cuda' or 'cuda:N'", 2),
    ("train-device-cuda", ["train", *T, "--train.device", "cuda"],
     "--train.device 'cuda': CUDA is not available on this machine; use --train.device cpu", 2, no_cuda),
    ("train-missing-corpus", ["train", *T, "--data.corpus", "{root}/nope.txt"],
     "{root}/nope.txt does not exist; pass an existing text file, a directory with train/valid/test files (e.g. "
     "train.txt), or one of: enwik8, text8, wt103, wt2, ptb, pennchar, lm1b, stdlib, recall", 2),
    ("train-empty-corpus", ["train", *T, "--data.corpus", "{root}/empty.txt"],
     "the train split of corpus 'empty' is empty ({root}/empty.txt[0:0]); give a non-empty file or larger split "
     "fractions", 2),
    ("train-latin1-corpus", ["train", *T, "--data.corpus", "{root}/latin1.txt", "--data.level", "char"],
     "{root}/latin1.txt is not UTF-8 text: invalid byte 0xe9 at byte offset 3; use level='byte' for binary or "
     "non-UTF-8 data", 2),
    ("train-level-unknown", ["train", *T, "--data.level", "klingon"],
     "DataConfig.level='klingon' is unknown; choose one of byte, char, word, bpe", 2),
    ("train-tgt-len-beyond-valid", ["train", *T, "--train.tgt_len", "2000"],
     "the validation split has 529 tokens, fewer than eval.batch_size x tgt_len + 1 = 4 x 2000 + 1 = 8,001: use "
     "a smaller --train.tgt_len or --eval.batch_size, or a corpus with a larger split", 2),
    ("train-out-is-file", ["train", *T, "--out", "{text}"],
     "--out {root}/code.txt is a file, not a directory; choose another --out", 2),
    ("train-used-run-dir", ["train", *T, "--out", "{run}"],
     "{run} already holds a run (best.json, checkpoints/, latest.json, metrics.jsonl, ...); continue it with "
     "txl train --resume {run}, start again with --overwrite (deletes it), or choose another --out", 2),
    ("train-resume-missing", ["train", "--resume", "{root}/nope"],
     "{root}/nope does not exist; pass a run directory (with latest.json) or a checkpoint directory (with "
     "config.json)", 2),
    ("train-resume-empty-dir", ["train", "--resume", "{root}/a_dir"],
     "{root}/a_dir holds no checkpoint (no latest.json, no config.json)", 2),
    ("train-resume-with-preset", ["train", "--resume", "{run}", "--preset", "tiny"],
     "--resume takes the run's config from its checkpoint; drop --config/--preset (override single fields with "
     "--SECTION.FIELD instead)", 2),
    ("train-resume-and-overwrite", ["train", "--resume", "{run}", "--overwrite"],
     "--resume continues a run and --overwrite deletes it; give one of them", 2),
    ("train-resume-truncated-state", ["train", "--resume", "{truncated_state}"],
     "{root}/truncated_state/checkpoints/step_00000002/train_state.pt is corrupt or truncated (RuntimeError); "
     "resume from an earlier checkpoint under checkpoints/", 2),
    ("train-resume-pickled-state", ["train", "--resume", "{pickled_state}"],
     "{root}/pickled_state/checkpoints/step_00000002/train_state.pt holds Python objects other than tensors and "
     "numbers, and txl never unpickles those (unpickling can run code): txl did not write it. Resume from another "
     "checkpoint under {root}/pickled_state/checkpoints, or start a new run from this checkpoint's weights (its "
     "model.safetensors holds tensors only) with txl train --init-from {pickled_state_ckpt}", 2),
    ("train-resume-corrupt-run-json", ["train", "--resume", "{bad_run_json}"],
     "{root}/bad_run_json/checkpoints/step_00000002/run.json is not valid JSON (...", 2),
    ("train-resume-other-vocab", ["train", "--resume", "{other_vocab}"],
     "the corpus vocabulary (byte level, 256 symbols) does not match the checkpoint's (byte level, 7 symbols, "
     "{root}/other_vocab/checkpoints/step_00000002/tokenizer); use the corpus and --data.level the model was "
     "trained with", 2),
    # -- txl eval
    ("eval-missing", ["eval", "{root}/nope"],
     "{root}/nope does not exist (and is not a Hugging Face Hub repo id like transfo-xl/transfo-xl-wt103)", 2),
    ("eval-not-a-run", ["eval", "{root}/a_dir"],
     "{root}/a_dir holds no checkpoint (no latest.json, no config.json)", 2),
    ("eval-batch-size-0", ["eval", "{run}", "--eval.batch_size", "0"],
     "EvalConfig.batch_size=0 must be a positive integer", 2),
    ("eval-batch-size-negative", ["eval", "{run}", "--eval.batch_size", "-2"],
     "EvalConfig.batch_size=-2 must be a positive integer", 2),
    ("eval-tgt-len-0", ["eval", "{run}", "--eval.tgt_len", "0"],
     "EvalConfig.tgt_len=0 must be a positive integer", 2),
    ("eval-mem-len-negative", ["eval", "{run}", "--eval.mem_len", "-3"],
     "EvalConfig.mem_len=-3 must be >= 0", 2),
    ("eval-max-batches-negative", ["eval", "{run}", "--max-batches", "-1"],
     "--max-batches -1 must be >= 0 (0: the whole split)", 2),
    ("eval-sweep-not-ints", ["eval", "{run}", "--sweep-mem", "a,b"],
     "--sweep-mem 'a,b' must be integers like 0,64,128", 2),
    ("eval-split-train", ["eval", "{run}", "--split", "train"],
     "argument --split: invalid choice: 'train' ...", 2),
    ("eval-device-tpu9", ["eval", "{run}", "--device", "tpu9"],
     "--device 'tpu9' is not a device; use cpu, cuda, cuda:N or auto", 2),
    ("eval-device-cuda", ["eval", "{run}", "--device", "cuda"],
     "--device 'cuda': CUDA is not available on this machine; use --device cpu", 2, no_cuda),
    ("eval-config-model-null", ["eval", "{null_model}"],
     "{root}/null_model/checkpoints/step_00000002/config.json: \"model\" is null, not an object of ModelConfig "
     "fields; the checkpoint's config is corrupt: restore it from a copy or save the model again", 2),
    ("eval-config-cutoffs-abc", ["eval", "{abc_cutoffs}"],
     "{root}/abc_cutoffs/checkpoints/step_00000002/config.json: ModelConfig.cutoffs='abc' must be a list of "
     "integers (token ids where the adaptive softmax's clusters start, e.g. [20000, 40000])", 2),
    ("eval-config-not-json", ["eval", "{bad_json}"],
     "{root}/bad_json/checkpoints/step_00000002/config.json is not valid JSON (...", 2),
    ("eval-config-no-format", ["eval", "{no_config_format}"],
     "{root}/no_config_format/checkpoints/step_00000002/config.json is neither a txl config (format: 'txl') nor "
     "a Hugging Face transfo-xl config (model_type: 'transfo-xl')", 2),
    ("eval-truncated-weights", ["eval", "{truncated_weights}"],
     "{root}/truncated_weights/checkpoints/step_00000002/model.safetensors is corrupt or truncated (Error while "
     "deserializing header: invalid header length); restore it or use an earlier checkpoint", 2),
    ("eval-no-weights", ["eval", "{no_weights}"],
     "no model.safetensors or pytorch_model.bin in {root}/no_weights/checkpoints/step_00000002", 2),
    ("eval-corrupt-pointer", ["eval", "{corrupt_latest}"],
     "{root}/corrupt_latest/best.json is corrupt; point it at a directory under "
     "{root}/corrupt_latest/checkpoints, or delete it", 2),
    ("eval-dangling-pointer", ["eval", "{dangling_latest}"],
     "{root}/dangling_latest/latest.json points at {root}/dangling_latest/checkpoints/step_00000002, which is "
     "missing", 2),
    ("eval-no-run-json", ["eval", "{no_run_json}"],
     "{root}/no_run_json/checkpoints/step_00000002 is a model without a training run: name the corpus to "
     "evaluate on with --corpus NAME|PATH (e.g. --corpus wt103 --data-dir data/wt103)", 2),
    ("eval-other-corpus", ["eval", "{run}", "--data.corpus", "{root}/latin1.txt"],
     "the valid split of corpus 'latin1' is empty ({root}/latin1.txt[10:10]); give a non-empty file or larger "
     "split fractions", 2),
    ("eval-ext-len-negative", ["eval", "{run}", "--eval.ext_len", "-1"],
     "EvalConfig.ext_len=-1 must be >= 0", 2),
    # -- txl generate
    ("generate-no-prompt", ["generate", *R],
     "one of the arguments --prompt --prompt-file is required", 2),
    ("generate-empty-prompt", ["generate", *R, "--prompt", "  "],
     "the prompt is empty: give some text with --prompt TEXT or --prompt-file FILE", 2),
    ("generate-prompt-file-missing", ["generate", *R, "--prompt-file", "{root}/nope.txt"],
     "--prompt-file {root}/nope.txt is missing: pass a text file", 2),
    ("generate-prompt-file-dir", ["generate", *R, "--prompt-file", "{root}/a_dir"],
     "--prompt-file {root}/a_dir is a directory: pass a text file", 2),
    ("generate-prompt-file-latin1", ["generate", *R, "--prompt-file", "{root}/latin1.txt"],
     "--prompt-file {root}/latin1.txt is not UTF-8 text (byte 3: invalid continuation byte); convert it, e.g. "
     "iconv -f latin1 -t utf-8", 2),
    ("generate-temperature-negative", ["generate", *R, "--prompt", "x", "--temperature", "-1"],
     "temperature=-1.0 must be >= 0 (0 means greedy: the most likely token)", 2),
    ("generate-top-p-zero", ["generate", *R, "--prompt", "x", "--top-p", "0"],
     "top_p=0.0 must be in (0, 1] (1 keeps every token)", 2),
    ("generate-top-p-above-one", ["generate", *R, "--prompt", "x", "--top-p", "1.5"],
     "top_p=1.5 must be in (0, 1] (1 keeps every token)", 2),
    ("generate-top-k-negative", ["generate", *R, "--prompt", "x", "--top-k", "-1"],
     "top_k=-1 must be an integer >= 0 (0 keeps every token)", 2),
    ("generate-max-new-tokens-negative", ["generate", *R, "--prompt", "x", "--max-new-tokens", "-1"],
     "SampleConfig.max_new_tokens=-1 must be >= 0", 2),
    ("generate-segment-len-0", ["generate", *R, "--prompt", "x", "--segment-len", "0"],
     "SampleConfig.segment_len=0 must be a positive integer", 2),
    ("generate-mem-len-negative", ["generate", *R, "--prompt", "x", "--mem-len", "-1"],
     "SampleConfig.mem_len=-1 must be >= 1 (none: the whole context)", 2),
    ("generate-device-tpu9", ["generate", *R, "--prompt", "x", "--device", "tpu9"],
     "--device 'tpu9' is not a device; use cpu, cuda, cuda:N or auto", 2),
    ("generate-device-cuda", ["generate", *R, "--prompt", "x", "--device", "cuda"],
     "--device 'cuda': CUDA is not available on this machine; use --device cpu", 2, no_cuda),
    ("generate-checkpoint-missing", ["generate", "--checkpoint", "{root}/nope", "--prompt", "x"],
     "{root}/nope does not exist (and is not a Hugging Face Hub repo id like transfo-xl/transfo-xl-wt103)", 2),
    ("generate-pickled-vocab", ["generate", "--checkpoint", "{hf_pickle}", "--prompt", "x"],
     "{root}/hf_pickle/vocab.pkl: the pickle does not hold a Transformer-XL vocabulary dict (expected a dict "
     "with 'idx2sym'), got int", 2),
    ("generate-pickled-weights", ["generate", "--checkpoint", "{pickled_bin}", "--prompt", "x"],
     "{root}/pickled_bin/pytorch_model.bin holds Python objects other than tensors and numbers, and txl never "
     "unpickles those (unpickling can run code); it was not written by txl: convert it to model.safetensors "
     "with a tool you trust, or use a checkpoint txl wrote", 2),
    ("generate-vocab-missing", ["generate", *R, "--prompt", "x", "--vocab", "{root}/nope.txt"],
     "--vocab {root}/nope.txt is not a file: pass the vocabulary (vocab.txt, one word a line, JSON, or the "
     "vocab.pkl that TransfoXLTokenizer.save_pretrained writes)", 2),
    # -- txl score
    ("score-file-missing", ["score", *R, "{root}/nope.txt"],
     "{root}/nope.txt is not a file: pass the documents to score", 2),
    ("score-file-is-dir", ["score", *R, "{root}/a_dir"],
     "{root}/a_dir is not a file: pass the documents to score", 2),
    ("score-file-latin1", ["score", *R, "{root}/latin1.txt"],
     "{root}/latin1.txt is not UTF-8 text (invalid continuation byte); convert it, e.g. iconv -f latin1 -t "
     "utf-8, and score it again", 2),
    ("score-output-is-dir", ["score", *R, "{text}", "-o", "{root}/a_dir"],
     "-o {root}/a_dir is a directory; give a file name, e.g. -o {root}/a_dir/scores.jsonl", 2),
    ("score-output-parent-missing", ["score", *R, "{text}", "-o", "{root}/nope/s.jsonl"],
     "-o {root}/nope/s.jsonl: the directory {root}/nope does not exist; create it first", 2),
    ("score-batch-size-0", ["score", *R, "{text}", "--batch-size", "0"],
     "EvalConfig.batch_size=0 must be a positive integer", 2),
    ("score-device-tpu9", ["score", *R, "{text}", "--device", "tpu9"],
     "--device 'tpu9' is not a device; use cpu, cuda, cuda:N or auto", 2),
    ("score-device-cuda", ["score", *R, "{text}", "--device", "cuda"],
     "--device 'cuda': CUDA is not available on this machine; use --device cpu", 2, no_cuda),
    # -- txl data
    ("data-unknown-corpus", ["data", "download", "wikipedia"],
     "unknown corpus 'wikipedia'; corpora that can be downloaded: enwik8, text8, wt103, wt2, ptb, pennchar, "
     "lm1b, stdlib, recall", 2),
    ("data-download-offline", ["data", "download", "ptb", "--dir", "{root}/ptb"],
     "could not download http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz: cannot resolve the host "
     "name www.fit.vutbr.cz ([Errno -3] Temporary failure in name resolution). Check the network connection, "
     "or fetch simple-examples.tgz another way and run: txl data download ptb --dir {root}/ptb --from-file FILE",
     1, offline),
    ("data-from-file-missing", ["data", "download", "ptb", "--dir", "{root}/ptb2", "--from-file", "{root}/nope.tgz"],
     "--from-file {root}/nope.tgz is not a file: pass the archive you downloaded", 2),
    ("data-from-file-junk", ["data", "download", "ptb", "--dir", "{root}/ptb3", "--from-file", "{root}/junk.tar.gz"],
     "{root}/ptb3/simple-examples.tgz is neither a zip nor a tar archive; cannot extract it", 2),
    ("data-archive-link-escape", ["data", "download", "ptb", "--dir", "{root}/ptb4", "--from-file",
        "{root}/escape.tar"],
     "archive member 'data/evil' of {root}/ptb4/simple-examples.tgz is unsafe ('data/evil' is a link to an "
     "absolute path); refusing to extract it: the archive is not the expected one", 2),
    ("data-archive-dotdot", ["data", "download", "ptb", "--dir", "{root}/ptb5", "--from-file", "{root}/dotdot.tar"],
     "archive member '../outside.txt' would be written outside {root}/ptb5; refusing to extract", 2),
    ("data-archive-zip-escape", ["data", "download", "ptb", "--dir", "{root}/ptb6", "--from-file",
        "{root}/escape.zip"],
     "archive member '../../outside.txt' would be written outside {root}/ptb6; refusing to extract", 2),
    ("data-from-file-wrong-archive", ["data", "download", "enwik8", "--dir", "{root}/e8", "--from-file",
        "{root}/escape.zip"],
     "--from-file {root}/escape.zip is not the enwik8 archive: its sha256 is ...", 2),
    ("data-from-file-many-files", ["data", "download", "lm1b", "--dir", "{root}/lm", "--from-file", "{text}"],
     "lm1b is made of 2 files (1-billion-word-language-modeling-benchmark-r13output.tar.gz, 1b_word_vocab.txt); "
     "put them under those names in --dir and run txl data download lm1b without --from-file", 2),
    ("data-archive-zip-symlink", ["data", "download", "ptb", "--dir", "{root}/ptb7", "--from-file",
        "{root}/link_then_file.zip"],
     "archive member 'data' of {root}/ptb7/simple-examples.tgz is a symbolic link; refusing to extract it: the "
     "archive is not the expected one", 2),
    ("data-archive-tar-refused-whole", ["data", "download", "ptb", "--dir", "{root}/ptb8", "--from-file",
        "{root}/good_then_bad.tar"],
     "archive member 'data/evil' of {root}/ptb8/simple-examples.tgz is unsafe ('data/evil' is a link to an "
     "absolute path); refusing to extract it: the archive is not the expected one", 2),
    # -- contradictory configuration (issue 27)
    ("train-same-length-no-memory", ["train", *T, "--model.mem_len", "0", "--model.same_length", "true"],
     "ModelConfig.same_length with mem_len=0 masks every key of a segment's first query (its loss is NaN): set "
     "mem_len >= 1, or same_length false", 2),
    ("train-vocab-size-disagrees", ["train", *T, "--model.vocab_size", "300"],
     "--model.vocab_size 300 disagrees with the corpus 'code', whose vocabulary has 256 symbols (the model's "
     "vocab_size is always the corpus's); drop --model.vocab_size", 2),
    ("train-shortcut-and-field", ["train", "--max-steps", "5", "--train.max_steps", "abc"],
     "--max-steps and --train.max_steps both set train.max_steps; give one of them", 2),
    ("train-field-then-shortcut", ["train", "--train.out_dir", "a", "--out", "b"],
     "--out and --train.out_dir both set train.out_dir; give one of them", 2),
    ("train-shortcut-bad-value", ["train", "--minutes", "soon"],
     "argument --minutes: invalid float value: 'soon'", 2),
    ("generate-shortcut-and-field", ["generate", *R, "--prompt", "x", "--top-k", "3", "--sample.top_k", "4"],
     "--top-k and --sample.top_k both set sample.top_k; give one of them", 2),
    ("score-shortcut-and-field", ["score", *R, "{text}", "--no-same-length", "--eval.same_length", "true"],
     "--no-same-length and --eval.same_length both set eval.same_length; give one of them", 2),
    ("eval-shortcut-and-field", ["eval", "{run}", "--corpus", "x", "--data.corpus", "y"],
     "--corpus and --data.corpus both set data.corpus; give one of them", 2),
    # -- a damaged run.json is refused, naming what it lacks (issue 27)
    ("train-resume-run-json-missing-field", ["train", "--resume", "{run_json_no_d_model}"],
     "{run_json_no_d_model_ckpt}/run.json lacks the field(s) model.d_model, which every saved run holds: the file "
     "is damaged and its defaults would change the run or its figures. Restore it from another checkpoint of the "
     "run (checkpoints/*/run.json, or run.json in the run directory)", 2),
    ("eval-run-json-missing-eval-field", ["eval", "{run_json_no_eval_tgt}"],
     "{run_json_no_eval_tgt_ckpt}/run.json lacks the field(s) eval.tgt_len, which every saved run holds: ...", 2),
    # -- honest evaluation figures, output files (issue 27)
    ("eval-tgt-len-beyond-split", ["eval", "{run}", "--eval.tgt_len", "100000"],
     "the test split has 529 tokens, fewer than eval.batch_size x tgt_len + 1 = 2 x 100000 + 1 = 200,001: use a "
     "smaller --eval.tgt_len or --eval.batch_size, or a corpus with a larger split", 2),
    ("eval-plot-parent-missing", ["eval", "{run}", "--sweep-mem", "0,4", "--plot", "{root}/nope/sweep.png"],
     "--plot {root}/nope/sweep.png: the directory {root}/nope does not exist; create it first", 2),
    ("eval-plot-is-dir", ["eval", "{run}", "--sweep-mem", "0,4", "--plot", "{root}/a_dir"],
     "--plot {root}/a_dir is a directory; give a file name, e.g. --plot {root}/a_dir/mem_sweep.png", 2),
    ("export-output-is-dir", ["export", *R, "-o", "{root}/a_dir"],
     "-o {root}/a_dir is a directory; give a file name, e.g. -o {root}/a_dir/step.pt2", 2),
    ("export-output-parent-missing", ["export", *R, "-o", "{root}/nope/step.pt2"],
     "-o {root}/nope/step.pt2: the directory {root}/nope does not exist; create it first", 2),
    ("export-output-parent-is-file", ["export", *R, "-o", "{text}/step.pt2"],
     "-o {text}/step.pt2: the directory {text} is a file, not a directory; create it first", 2),
    ("export-onnx-no-temporary", ["export", *R, "--format", "onnx", "-o", "{root}/step.onnx"],
     "could not write {root}/step.onnx (No such file or directory); nothing was written there", 1,
     no_temporary_directory),
    ("data-prepare-missing", ["data", "prepare", "{root}/nope.txt"],
     "{root}/nope.txt does not exist; pass an existing text file, a directory with train/valid/test files (e.g. "
     "train.txt), or one of: enwik8, text8, wt103, wt2, ptb, pennchar, lm1b, stdlib, recall", 2),
    ("data-prepare-empty", ["data", "prepare", "{root}/blank.txt", "--data.level", "char"],
     "the test split of corpus 'blank' is empty ({root}/blank.txt[5:5]); give a non-empty file or larger split "
     "fractions", 2),
    ("data-prepare-level", ["data", "prepare", "{text}", "--data.level", "klingon"],
     "DataConfig.level='klingon' is unknown; choose one of byte, char, word, bpe", 2),
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
    monkeypatch.chdir(tmp_path)  # anything a case would write by default lands here
    rc, out, err = run_cli([a.format(**world) for a in argv])
    assert "Traceback" not in err and "pwned" not in out + err, err  # no traceback, no unpickled code ran
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err  # one line, the last one
    message = errors[0].split("error: ", 1)[1]
    print(f"@@ {name} rc={rc} :: {errors[0]}")  # pytest -s shows every message, to review a change
    expected = expected.format(**world)
    if expected.endswith("..."):
        assert message.startswith(expected[:-3].rstrip()), message
    else:
        assert message == expected
    assert rc == code


def test_the_table_is_large_and_unique():
    names = [c[0] for c in CASES]
    assert len(names) >= 60 and len(set(names)) == len(names)


def test_no_command_offers_allow_pickle():
    """A pickled vocabulary is always read with the restricted unpickler (txl.data.tokenizer.hf_vocab), so no
    command has a flag to allow it: `txl serve --help` offered one that did nothing."""
    from txl.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert "serve" in commands
    offered = sorted(name for name, p in commands.items() if "--allow-pickle" in p._option_string_actions)
    assert offered == []
