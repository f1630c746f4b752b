"""Generation and scoring end to end: a tiny Hugging Face transfo-xl directory and a txl checkpoint, via
the API and the `txl generate` / `txl score` commands; bad input gives one clear line."""

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
from txl.cli import main
from txl.data.tokenizer import load_model_tokenizer, save_tokenizer
from txl.data.tokenizer.hf_vocab import write_vocab_txt

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


WORDS = ("<eos> <unk> the . , cat sat on mat a dog It 's state @-@ of art model 5 @,@ 000 was "
         "( ) and in to is new big red").split()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random transfo-xl in the Hugging Face layout, with a vocabulary in the HF plain format: saved by
    transformers where the oracle is installed (.ci/run's oracle environment), else by txl.save_hf, whose
    files test_checkpoints.py proves transformers reads."""
    from txl.convert.hf import config_to_hf

    torch.manual_seed(0)
    # The vocabulary below; wt103's kind of model: adaptive clusters, and an evaluation context (same_length,
    # clamp_len, mem_len 8) that the score tests change from the command line.
    config = tiny_config(vocab_size=len(WORDS), cutoffs=[10, 20], div_val=2, mem_len=8, clamp_len=1000,
                         same_length=True)
    directory = tmp_path_factory.mktemp("hf")
    try:
        import transformers
    except ImportError:
        txl.save_hf(txl.TransformerXL(config), directory)
    else:
        transformers.TransfoXLLMHeadModel(transformers.TransfoXLConfig(**config_to_hf(config))).save_pretrained(
            directory)
    write_vocab_txt(WORDS, directory / "vocab.txt")
    return directory


def run_cli(capsys, *argv):
    rc = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def test_hf_generate_api_streams_wt103_text(hf_dir):
    model = txl.from_pretrained(hf_dir)
    tok = load_model_tokenizer(hf_dir, vocab_size=model.config.vocab_size)
    ids = tok.encode_prompt("It's a state-of-the-art model, 5,000")
    assert tok.decode(ids) == "It's a state-of-the-art model, 5,000"  # WikiText-103 round trip
    assert [tok.vocab.symbols[i] for i in ids][:4] == ["It", "'s", "a", "state"]
    new = txl.generate(model, ids, max_new_tokens=30, seed=1)[0].tolist()
    stream = tok.stream()
    shown = "".join(stream.push(t) for t in new) + stream.finish()
    assert shown.split() and "".join(shown.split()) == "".join(tok.decode(new).split())  # spacing may differ
    words = [tok.vocab.index[w] for w in "the cat sat on a mat . <eos> It 's 5 @,@ 000 .".split()]
    stream = tok.stream()
    pieces = [stream.push(t) for t in words] + [stream.finish()]
    assert "".join(pieces) == tok.decode(words) == "the cat sat on a mat.\nIt's 5,000."
    assert pieces[:3] == ["", "the", " cat"]  # shown as produced, one token behind


def test_unknown_words_warn_and_vocab_without_unk_fails(hf_dir, tmp_path, caplog):
    tok = load_model_tokenizer(hf_dir)
    with caplog.at_level(logging.WARNING, logger="txl.data.tokenizer.levels"):
        ids = tok.encode_prompt("the zebra sat on the quokka")
    assert ids.count(tok.unk_id) == 2 and tok.unk_id == tok.vocab.unk_id == 1 and tok.eos_id == 0
    assert "'zebra'" in caplog.text and "'quokka'" in caplog.text
    write_vocab_txt([w for w in WORDS if w != "<unk>"], tmp_path / "vocab.txt")
    with pytest.raises(ValueError, match="no <unk>"):
        load_model_tokenizer(hf_dir, vocab_file=tmp_path / "vocab.txt").encode_prompt("the zebra")


def added_tokens_dir(directory, added, vocab_size):
    """A Hugging Face snapshot whose tokenizer has added tokens: vocab.txt, and the added_tokens.json that
    TransfoXLTokenizer.save_pretrained writes ({token: id}, ids after the vocabulary's), the model sized
    ``vocab_size``."""
    torch.manual_seed(0)
    txl.save_hf(txl.TransformerXL(tiny_config(vocab_size=vocab_size, cutoffs=[10, 20], div_val=2)), directory)
    write_vocab_txt(WORDS, directory / "vocab.txt")
    (directory / "added_tokens.json").write_text(json.dumps({t: len(WORDS) + i for i, t in enumerate(added)}))
    return directory


def test_added_tokens_are_read_as_transformers_reads_them(tmp_path, capsys):
    """vocab_size = len(tokenizer): the added tokens follow the vocabulary, at the ids transformers gives them;
    a model sized for the vocabulary alone (TransfoXLTokenizer adds <formula> by default, which the model never
    had) reads the vocabulary alone; ids that do not follow the vocabulary are refused, naming the file."""
    n = len(WORDS)
    grown = added_tokens_dir(tmp_path / "grown", ["<formula>", "newword"], n + 2)
    tok = load_model_tokenizer(grown, vocab_size=n + 2)
    assert tok.vocab_size == n + 2
    idx = tok.vocab.index
    assert tok.encode_prompt("the <formula> cat newword") == [idx["the"], n, idx["cat"], n + 1]
    assert tok.decode([n, idx["sat"], n + 1]) == "<formula> sat newword"
    rc, out, err = run_cli(capsys, "generate", "--checkpoint", grown, "--prompt", "the <formula> cat newword",
                           "--max-new-tokens", "3", "--seed", "0")
    assert rc == 0 and "Traceback" not in err, err

    base = added_tokens_dir(tmp_path / "base", ["<formula>"], n)
    tok = load_model_tokenizer(base, vocab_size=n)
    assert tok.vocab_size == n and tok.encode_prompt("<formula>") == [tok.unk_id]
    assert load_model_tokenizer(base).vocab_size == n  # the model's config.json says so when no vocab_size is given
    assert load_model_tokenizer(grown).vocab_size == n + 2

    (grown / "added_tokens.json").write_text(json.dumps({"<formula>": n + 1}))  # a gap at id n
    with pytest.raises(ValueError, match=r"added_tokens.json: the added tokens must take the ids after"):
        load_model_tokenizer(grown, vocab_size=n + 2)


def test_cli_generate_is_reproducible(hf_dir, capsys):
    args = ["generate", "--checkpoint", hf_dir, "--prompt", "the cat sat", "--max-new-tokens", 12,
            "--temperature", 0.8, "--top-k", 10, "--top-p", 0.9, "--seed", 3]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0 and len(out.split()) >= 3, err
    assert run_cli(capsys, *args)[1] == out


def test_cli_stop_string_cuts_the_text_where_it_first_appears(hf_dir, capsys):
    args = ["generate", "--checkpoint", hf_dir, "--prompt", "the cat sat", "--max-new-tokens", 30,
            "--temperature", 0.9, "--seed", 5]
    rc, full, _ = run_cli(capsys, *args)
    words = full.split()
    stop = words[len(words) // 2]  # a word in the middle of the free output
    rc, cut, err = run_cli(capsys, *args, "--stop", stop)
    assert rc == 0, err
    assert cut.rstrip("\n") == full[:full.index(stop)]  # the same text, up to the first occurrence


@pytest.mark.parametrize("extra,match", [
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "x", "--repetition-penalty", "0"], "repetition_penalty"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    (["--prompt", "x", "--top-k", "-3"], "top_k"),
    (["--prompt", "x", "--max-new-tokens", "-1"], "max_new_tokens"),
])
def test_cli_bad_input_is_one_line(hf_dir, capsys, extra, match):
    rc, out, err = run_cli(capsys, "generate", "--checkpoint", hf_dir, *extra)
    assert rc == 2 and match in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_checkpoint_without_vocabulary(tmp_path, capsys):
    model = txl.TransformerXL(tiny_config())
    txl.save_pretrained(model, tmp_path)
    rc, _, err = run_cli(capsys, "generate", "--checkpoint", tmp_path, "--prompt", "hello")
    assert rc == 2 and "has no vocabulary" in err and len(err.strip().splitlines()) == 1


def test_cli_score_jsonl_and_perplexity(hf_dir, tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the cat sat on the mat .\nIt 's a big red dog .\n")
    b.write_text("a dog .\n")
    rc, out, err = run_cli(capsys, "score", "--checkpoint", hf_dir, "--pretokenized", "--segment-len", 4, a, b)
    assert rc == 0, err
    assert sorted(line.split(":")[0] for line in out.splitlines()) == [str(a), str(b)]  # no -o: a line per document
    assert "tokens, ppl" in out and "(segment_len 4, mem_len" in out
    rc, out, err = run_cli(capsys, "score", "--checkpoint", hf_dir, "--pretokenized", "--segment-len", 4, a, b,
                           "-o", "-")
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    tokens = [r for r in lines if "token" in r and r["doc"] == str(a)]
    assert [r["token"] for r in tokens] == a.read_text().replace("\n", " <eos> ").split()  # every word scored
    [total] = [r for r in lines if "ppl" in r and r["doc"] == str(a)]
    assert total["tokens"] == len(tokens)
    mean = -sum(r["logprob"] for r in tokens) / len(tokens)
    assert math.isclose(total["ppl"], math.exp(mean), rel_tol=1e-4)
    assert f"{a}: {len(tokens)} tokens, ppl" in err


def test_cli_score_takes_the_evaluation_context(hf_dir, tmp_path, capsys):
    """--clamp-len and --same-length reach the model: the totals equal the API's with the same context."""
    from txl.data.tokenizer import load_model_tokenizer

    a = tmp_path / "a.txt"
    a.write_text("the cat sat on the mat .\nIt 's a big red dog .\n" * 3)
    common = ["score", "--checkpoint", hf_dir, "--pretokenized", "--segment-len", 4, "--mem-len", 6, "--totals-only",
              "-o", "-"]
    totals = {}
    for extra in ([], ["--clamp-len", 2, "--no-same-length"]):
        rc, out, err = run_cli(capsys, *common, *extra, a)
        assert rc == 0, err
        totals[len(extra)] = json.loads(out)["nll"]
    model = txl.from_pretrained(hf_dir)
    tok = load_model_tokenizer(hf_dir, pretokenized=True)
    ids = list(tok.encode_lines(a.read_text().splitlines(keepends=True)))
    [api] = txl.score_documents(model, [ids], segment_len=4, mem_len=6, clamp_len=2, same_length=False,
                                context_id=tok.context_id)
    assert math.isclose(totals[3], api.nll, rel_tol=1e-6) and not math.isclose(totals[3], totals[0], rel_tol=1e-6)


def test_txl_checkpoint_with_byte_tokenizer_scores_bits_per_byte(tmp_path, capsys):
    from txl.data import fit_tokenizer, make_spec
    from txl.data.sources import Source

    text = tmp_path / "train.txt"
    text.write_text("hello world\nhello there\n")
    tok = fit_tokenizer(make_spec("byte"), [Source(text)])
    model = txl.TransformerXL(tiny_config(vocab_size=tok.vocab_size))  # the tokenizer's vocabulary
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"  # a training run's layout: found through best.json
    txl.save_pretrained(model, ckpt)
    save_tokenizer(tok, ckpt / "tokenizer")
    (tmp_path / "run" / "best.json").write_text(json.dumps({"step": 1, "path": "checkpoints/step_1"}))
    rc, out, err = run_cli(capsys, "score", "--checkpoint", tmp_path / "run", "--totals-only", "-o", "-", text)
    assert rc == 0, err
    [total] = [json.loads(line) for line in out.splitlines()]
    assert total["tokens"] == len(text.read_bytes()) and total["bpc"] == pytest.approx(total["bits_per_token"])
    rc, out, err = run_cli(capsys, "generate", "--checkpoint", ckpt, "--prompt", "hel", "--max-new-tokens", 5,
                           "--seed", 0)
    assert rc == 0, err
    tok = load_model_tokenizer(ckpt)
    assert np.array_equal(tok.encode_prompt("hé"), list("hé".encode()))


@pytest.mark.slow  # a real subprocess
def test_readme_generation_example_runs(tmp_path):
    import re
    import subprocess
    import sys

    readme = Path(__file__).resolve().parents[1] / "README.md"
    section = readme.read_text().split("## Generation and scoring", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120,
                            env={"PYTHONPATH": str(readme.parent / "src"), "PATH": "", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr


def _byte_checkpoint(tmp_path, run: dict | None = None):
    """A byte-level txl checkpoint directory; with ``run``, a run.json whose sections are ``run``'s."""
    from txl.checkpoint import RUN_FILE
    from txl.config import RunConfig
    from txl.data import fit_tokenizer, make_spec
    from txl.data.sources import Source

    text = tmp_path / "train.txt"
    text.write_text("hello world\nhello there\n" * 3)
    tok = fit_tokenizer(make_spec("byte"), [Source(text)])
    config = tiny_config(vocab_size=tok.vocab_size)  # the tokenizer's vocabulary
    model = txl.TransformerXL(config)
    ckpt = tmp_path / "ckpt"
    txl.save_pretrained(model, ckpt)
    save_tokenizer(tok, ckpt / "tokenizer")
    if run is not None:
        cfg = RunConfig.from_dict({"model": vars(config), **run}).to_dict()
        (ckpt / RUN_FILE).write_text(json.dumps(cfg))
    return ckpt, text


def test_generate_shortcuts_are_the_sample_fields(hf_dir, capsys):
    """--temperature is --sample.temperature: the same sample; a misspelt field names the valid ones."""
    short = ["--max-new-tokens", 10, "--temperature", 0.7, "--top-k", 5, "--seed", 4]
    long = ["--sample.max_new_tokens", 10, "--sample.temperature", 0.7, "--sample.top_k", 5, "--sample.seed", 4]
    base = ["generate", "--checkpoint", hf_dir, "--prompt", "the cat sat"]
    rc, a, err = run_cli(capsys, *base, *short)
    assert rc == 0, err
    assert run_cli(capsys, *base, *long)[1] == a
    rc, _, err = run_cli(capsys, *base, "--sample.temprature", 0.7)
    assert rc == 2 and "unknown field sample.temprature" in err and "temperature" in err
    rc, _, err = run_cli(capsys, *base, "--sample.top_p", "lots")
    assert rc == 2 and "sample.top_p='lots' must be a number" in err


def test_generate_defaults_come_from_the_runs_sample_section(tmp_path, capsys):
    """A run's [sample] (greedy, 6 tokens) is what `txl generate` does unless told otherwise."""
    ckpt, _ = _byte_checkpoint(tmp_path, {"sample": {"temperature": 0.0, "max_new_tokens": 6}})
    base = ["generate", "--checkpoint", ckpt, "--prompt", "hel"]
    rc, greedy, err = run_cli(capsys, *base)
    assert rc == 0, err
    assert run_cli(capsys, *base)[1] == greedy  # greedy: no seed needed to repeat it
    assert run_cli(capsys, *base, "--temperature", 0, "--max-new-tokens", 6)[1] == greedy
    sampled = {run_cli(capsys, *base, "--temperature", 1.0, "--seed", s)[1] for s in range(4)}
    assert len(sampled) > 1  # the option wins over the run's setting


def test_score_shortcuts_are_the_eval_fields_and_the_run_sets_the_defaults(tmp_path, capsys):
    ckpt, text = _byte_checkpoint(tmp_path, {"eval": {"tgt_len": 5, "mem_len": 3}})
    base = ["score", "--checkpoint", ckpt, text]
    rc, out, err = run_cli(capsys, *base)
    assert rc == 0, err
    assert "(segment_len 5, mem_len 3)" in out  # the run's [eval] context
    totals = {}
    for name, extra in (("short", ["--segment-len", 7, "--mem-len", 2]),
                        ("long", ["--eval.tgt_len", 7, "--eval.mem_len", 2])):
        rc, out, err = run_cli(capsys, *base, *extra, "--totals-only", "-o", "-")
        assert rc == 0, err
        totals[name] = json.loads(out)["nll"]
    assert totals["short"] == totals["long"]
    assert "(segment_len 7, mem_len 2)" in err
    rc, _, err = run_cli(capsys, *base, "--eval.ext_len", 2)
    assert rc == 2 and "eval.ext_len=2" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run_cli(capsys, *base, "--model.d_model", 8)
    assert rc == 2 and "takes no --model.FIELD options" in err


def test_cli_score_writes_totals_in_the_order_given(hf_dir, tmp_path, capsys):
    """Documents read together finish shortest first; their totals (JSONL and summary lines) come out in the
    order the files were given."""
    files = []
    for name, lines in (("long", 6), ("short", 1), ("mid", 3)):
        files.append(tmp_path / f"{name}.txt")
        files[-1].write_text("the cat sat on the mat .\n" * lines)
    rc, out, err = run_cli(capsys, "score", "--checkpoint", hf_dir, "--pretokenized", "--segment-len", 4,
                           "--totals-only", "-o", "-", *files)
    assert rc == 0, err
    assert [json.loads(line)["doc"] for line in out.splitlines()] == [str(f) for f in files]
    assert [line.split(":")[0] for line in err.splitlines() if "tokens, ppl" in line] == [str(f) for f in files]
    rc, out, err = run_cli(capsys, "score", "--checkpoint", hf_dir, "--pretokenized", "--segment-len", 4, *files)
    assert [line.split(":")[0] for line in out.splitlines()] == [str(f) for f in files]
