"""lm-evaluation-harness against txl: its own task runner on a local text file (a wikitext-style
loglikelihood_rolling task: word_perplexity, byte_perplexity, bits_per_byte), the model read in process
(``--model txl``) and over HTTP (``--model local-completions`` against ``txl serve``, nothing but base_url,
model and tokenizer given); bits_per_byte equals `txl score` on the same text. Skipped without the lmeval
extra (``pip install 'txl[lmeval]'``; .ci/run installs it)."""

from __future__ import annotations

import json
import math
import re

import pytest

pytest.importorskip("lm_eval")

from serve_util import TEXT, make_model_dir  # noqa: E402

from txl.cli import main as txl_main  # noqa: E402

TASK = """task: txl_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def write_task(directory, docs: list[str]):
    """A local lm-eval task over ``docs`` (JSON lines, one document each) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "docs.jsonl").write_text("".join(json.dumps({"page": d}) + "\n" for d in docs), encoding="utf-8")
    (directory / "txl_text.yaml").write_text(TASK.format(docs=directory / "docs.jsonl"), encoding="utf-8")
    return directory


def run_task(model, task_dir) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, tasks=["txl_text"], task_manager=manager, bootstrap_iters=0,
                                  log_samples=False)
    return out["results"]["txl_text"]


def txl_score_nll(capsys, directory, path) -> float:
    """`txl score MODEL FILE`'s total NLL (nats) of the file, as the command writes it."""
    capsys.readouterr()
    assert txl_main(["score", "--checkpoint", str(directory), "--totals-only", "-o", "-", str(path)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["tokens"] > 0
    return rows[0]["nll"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file; nothing is fetched
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["word", "char"])
def test_in_process_bits_per_byte_equal_txl_score(tmp_path, capsys, level):
    """`txl-lm-eval --model txl` reads each document with memory, segment by segment (TEXT is several segments long
    and the model's memory only 8), exactly as `txl score` reads the same text: the prefix lm-eval reads first is
    txl score's own context token (<eos>, the line break)."""
    from txl.lmeval import TxlLM

    directory = make_model_dir(tmp_path / "model", level=level)
    lm = TxlLM(pretrained=str(directory), batch_size=1)
    assert lm.segment_len == 128 and len(lm.tok_encode(TEXT)) > 2 * 8  # more than the memory holds
    result = run_task(lm, write_task(tmp_path / "task", [TEXT]))
    text = tmp_path / "doc.txt"
    text.write_text(TEXT, encoding="utf-8")
    nll = txl_score_nll(capsys, directory, text)
    n_bytes = len(TEXT.encode("utf-8"))
    assert result["bits_per_byte,none"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-9)
    assert result["byte_perplexity,none"] == pytest.approx(math.exp(nll / n_bytes), rel=1e-9)


@pytest.mark.slow
def test_in_process_loglikelihood_and_generation(tmp_path):
    """loglikelihood: log p(context | prefix) + log p(continuation | prefix, context) is the document's rolling
    log-likelihood (chain rule; a context is read as given, so it starts with the prefix, a line break here),
    and is_greedy agrees with greedy generation; generate_until is txl.generate cut at its first stop text."""
    from lm_eval.api.instance import Instance

    from txl.lmeval import TxlLM

    lm = TxlLM(pretrained=str(make_model_dir(tmp_path / "model", level="char")), batch_size=2)
    ctx, cont = "The cat sat on", " the mat."
    assert lm.tok_encode("\n") == [lm.prefix_token_id]
    req = [Instance("loglikelihood", {}, ("\n" + ctx, cont), 0), Instance("loglikelihood", {}, ("", ctx), 1)]
    (lp, greedy), (lp_ctx, _) = lm.loglikelihood(req)
    whole = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ctx + cont,), 0)])[0]
    assert lp + lp_ctx == pytest.approx(whole, abs=1e-6) and lp < 0
    made = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["zzz"], "max_gen_toks": len(cont)}), 0)])
    assert greedy == (made[0] == cont)
    (lp_made, greedy_made), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, made[0]), 0)])
    assert greedy_made and lp_made <= 0
    stop = made[0][len(made[0]) // 2]
    cut = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": [stop], "max_gen_toks": 9}), 0)])
    assert cut[0] == made[0][:made[0].index(stop)]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("level", ["word", "char"])
def test_local_completions_against_txl_serve_equal_txl_score(tmp_path, capsys, level):
    """`lm_eval --model local-completions --model_args base_url=.../v1/completions,model=tiny`, nothing else: lm-eval
    finds the tokenizer endpoints (/tokenizer_info, /tokenize), reads the prefix from eos_token, sends token-id
    prompts with echo and logprobs, and reads dict top_logprobs. TEXT fits one lm-eval window (2047 tokens), read
    by the server in segments of 128 with memory: bits_per_byte equals `txl score`'s, and the in-process model's."""
    pytest.importorskip("fastapi")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from serve_util import loader, running

    from txl.serve import ServeConfig, create_app

    # lm-eval probes /tokenize with the word 'test': a word vocabulary needs its <unk> (as WikiText's has).
    directory = make_model_dir(tmp_path / "model", level=level, spec={"specials": ["<eos>", "<unk>"]} if
                               level == "word" else None)
    task = write_task(tmp_path / "task", [TEXT])
    app = create_app(ServeConfig(state_dir=str(tmp_path / "state"), durability="shutdown"), loader(directory))
    with running(app) as url:
        out = lm_eval.simple_evaluate(model="local-completions", model_args=f"base_url={url}/v1/completions,model=tiny",
                                      tasks=["txl_text"], bootstrap_iters=0, log_samples=False,
                                      task_manager=TaskManager(include_path=str(task), include_defaults=False))
        # loglikelihood (multiple-choice tasks): the HTTP model's answers are the in-process model's, is_greedy too.
        from lm_eval.api.instance import Instance
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        from txl.lmeval import TxlLM

        made = TxlLM(pretrained=str(directory)).generate_until(
            [Instance("generate_until", {}, ("The cat sat", {"until": ["zzz"], "max_gen_toks": 3}), 0)])[0]
        pairs = [("The cat sat", " on the"), ("", "The cat"), ("The cat sat", made)]
        reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
        remote = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="tiny").loglikelihood(reqs)
    local = TxlLM(pretrained=str(directory)).loglikelihood(reqs)
    assert [g for _, g in remote] == [g for _, g in local] and remote[2][1]  # the greedy continuation is greedy
    assert [lp for lp, _ in remote] == pytest.approx([lp for lp, _ in local], abs=1e-5)
    result = out["results"]["txl_text"]
    text = tmp_path / "doc.txt"
    text.write_text(TEXT, encoding="utf-8")
    nll = txl_score_nll(capsys, directory, text)
    n_bytes = len(TEXT.encode("utf-8"))
    assert result["bits_per_byte,none"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-6)
    words = len(re.split(r"\s+", TEXT))  # as lm-eval counts them
    assert result["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-6)


@pytest.mark.parametrize("level", ["word", "char", "byte"])
def test_lm_eval_and_txl_score_agree_on_the_same_documents(tmp_path, capsys, level):
    """One rule for a document (``Tokenizer.context_id``): it is read after the context token (word: <eos>; char,
    byte: the line break), so its first token is scored, and its tokens are its text's, no <eos> added after a
    last line without a line break. lm-eval's rolling log-likelihood (what its perplexity tasks ask the txl model
    for) is then minus `txl score`'s total NLL on the same files: with a final line break, without, one line."""
    from lm_eval.api.instance import Instance

    from txl.lmeval import TxlLM

    directory = make_model_dir(tmp_path / "model", level=level)
    docs = [TEXT, TEXT.rstrip("\n"), "The cat sat on the mat."]
    files = []
    for i, doc in enumerate(docs):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(doc, encoding="utf-8")
    capsys.readouterr()
    assert txl_main(["score", "--checkpoint", str(directory), "--totals-only", "-o", "-", *map(str, files)]) == 0
    totals = {row["doc"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    lm = TxlLM(pretrained=str(directory), batch_size=2)
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)])
    for doc, path, ll in zip(docs, files, rolling):
        total = totals[str(path)]
        assert ll == pytest.approx(-total["nll"], rel=1e-6, abs=1e-6)
        if level == "word":  # a word or <eos> for each line break, and nothing after the last word
            assert total["tokens"] == len(doc.split()) + doc.count("\n")
        else:  # every character, or byte, the first too
            assert total["tokens"] == len(doc if level == "char" else doc.encode("utf-8"))


def test_unknown_model_args_are_refused_in_one_line(tmp_path):
    from txl.lmeval import TxlLM

    with pytest.raises(ValueError, match="unknown model_args for the txl model: colour"):
        TxlLM(pretrained=str(make_model_dir(tmp_path / "model")), colour="red")


def test_registering_txl_keeps_lm_evals_own_models():
    """lm-eval fills its registry with its own models only while the registry is empty: importing txl.lmeval
    first must not hide them (it imports them before registering 'txl')."""
    from lm_eval.api.registry import get_model

    from txl.lmeval import TxlLM

    assert get_model("txl") is TxlLM
    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"


def test_the_txl_lm_eval_command_is_installed_and_names_the_extra(monkeypatch, capsys):
    """lm-eval 0.4 reads no entry points (its registry holds its own models and those registered in the process),
    so `lm_eval --model txl` cannot work: the package installs `txl-lm-eval`, lm-eval's command line with the model
    registered, which is what the module's docstring and the README show. Without lm-eval it says which extra."""
    import importlib
    import sys
    from pathlib import Path

    import txl.lmeval

    root = Path(__file__).resolve().parents[1]
    [(module, name)] = re.findall(r'^txl-lm-eval = "([\w.]+):(\w+)"$', (root / "pyproject.toml").read_text(), re.M)
    entry = getattr(importlib.import_module(module), name)
    for text in (txl.lmeval.__doc__, (root / "README.md").read_text()):
        assert "txl-lm-eval --model txl" in text
        assert not re.search(r"^\s*lm_eval --model txl", text, re.M)  # a command that cannot find the model
    monkeypatch.setitem(sys.modules, "txl.lmeval", None)  # as without the [lmeval] extra
    assert entry() == 2
    assert capsys.readouterr().err.strip().startswith("txl-lm-eval: ")


@pytest.mark.slow
def test_txl_lm_eval_runs_a_task_with_the_txl_model(tmp_path, monkeypatch):
    """The `txl-lm-eval` command (its entry function, lm-eval's own argument parsing) finds `--model txl`."""
    import sys

    from txl.__main__ import lm_eval_entry

    directory = make_model_dir(tmp_path / "model", level="char")
    task = write_task(tmp_path / "task", [TEXT[:200]])
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["txl-lm-eval", "--model", "txl", "--model_args", f"pretrained={directory}",
                                      "--tasks", "txl_text", "--include_path", str(task), "--device", "cpu",
                                      "--output_path", str(out)])
    assert lm_eval_entry() == 0
    [result] = list(out.rglob("results_*.json"))
    assert json.loads(result.read_text())["results"]["txl_text"]["bits_per_byte,none"] > 0
