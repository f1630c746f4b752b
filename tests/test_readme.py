"""Every command block of the README runs, so the README cannot drift (issue 28).

The convention, for everyone who adds a README section:

* A fenced block tagged ```bash or ```python is a command block: it runs here, as written, in README order, in
  one scratch directory, so a later block may use what an earlier one wrote (``runs/default``, ``runs/mine``).
  An untagged block (```) is output or a file layout and is not run: tag a block of commands ```bash.
* An HTML comment right before a block (blank lines may separate them) changes how it runs, one directive a
  line (or one directive on the comment's own line: ``<!-- docs-test: skip: needs a GPU -->``)::

      <!-- docs-test
      skip: WHY              the block is not run; WHY is the skip reason pytest reports (-rs)
      slow                   the block takes seconds (deselected by -m "not slow")
      sub: OLD => NEW        run the block with the text OLD replaced by NEW (OLD must occur; repeatable)
      serve: ARGS            `txl serve ARGS` runs while the block runs (a free port, its own state directory),
                             and the block's http://127.0.0.1:8000 is that server's address
      -->

  Substitutions stand for tiny sizes (a tiny preset, a few steps, ``--help`` instead of an hours-long run) and
  for local stand-ins of what the network would give; the rest of the command runs as written.
* The scratch directory holds those stand-ins (:func:`workspace`): a Hugging Face Hub cache, read with
  HF_HUB_OFFLINE=1, whose ``transfo-xl/transfo-xl-wt103`` is tests/golden/hf_transfo_xl_tiny (what
  transformers' ``save_pretrained`` writes; no local ``transfo-xl-wt103/``: a block names the Hub id); ``my.txt``;
  ``my_corpus/`` and ``my_text/`` (train/valid/test.txt, in that vocabulary's words); a fake WikiText-103
  (``data/wt103``, and ``wiki.test.tokens``) and Penn Treebank (``data/ptb``, as ``txl data download`` leaves them).
* bash blocks run under ``bash -euo pipefail`` with this Python's bin directory first on PATH (``txl``,
  ``python``, ``torchrun``), OMP_NUM_THREADS=1 and the caches (XDG_CACHE_HOME) inside the scratch directory;
  python blocks run with this Python. A block passes when it exits with status 0.

Besides the blocks, every ``txl.NAME.NAME`` the README names in backticks must exist (``txl.generation.FINISHED``)
and every checkpoint path it shows must be spelt as training writes it (``step_00002000``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GOLDEN = Path(__file__).resolve().parent / "golden" / "hf_transfo_xl_tiny"
WORDS = "<eos> <unk> the cat sat on a mat . dog = Valkyria".split()  # the golden repo's vocabulary
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FENCE = re.compile(r"(?:<!--\s*docs-test(?P<directives>.*?)-->\s*)?^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```\s*$",
                   re.S | re.M)


@dataclass
class Block:
    line: int
    lang: str
    body: str
    skip: str | None = None
    slow: bool = False
    serve: str | None = None
    subs: list[tuple[str, str]] = field(default_factory=list)

    def text(self) -> str:
        """The block as it runs: each substitution applied, each required to match."""
        body = self.body
        for old, new in self.subs:
            assert old in body, f"README line {self.line}: the substitution's text {old!r} is not in the block"
            body = body.replace(old, new)
        return body


def parse_directives(text: str, line: int) -> dict:
    """The directives of a ``<!-- docs-test ... -->`` comment (see the module docstring)."""
    out: dict = {"skip": None, "slow": False, "subs": [], "serve": None}
    for raw in re.split(r"\n", text.strip().removeprefix(":").strip()):
        item = raw.strip()
        if not item:
            continue
        key, _, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key == "skip":
            assert value, f"README line {line}: 'skip:' needs a reason"
            out["skip"] = value
        elif key == "slow" and not value:
            out["slow"] = True
        elif key == "serve" and value:
            out["serve"] = value
        elif key == "sub" and "=>" in value:
            old, _, new = value.partition("=>")
            out["subs"].append((old.strip(), new.strip()))
        else:
            raise AssertionError(f"README line {line}: unknown docs-test directive {item!r} (skip: WHY, slow, "
                                 "sub: OLD => NEW, serve: ARGS)")
    return out


def readme_blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        if m.group("lang") not in ("bash", "python"):
            assert m.group("directives") is None, f"README line {line}: docs-test directives on a block that is not run"
            continue
        directives = parse_directives(m.group("directives") or "", line)
        blocks.append(Block(line=line, lang=m.group("lang"), body=m.group("body"), **directives))
    return blocks


BLOCKS = readme_blocks()


def _words(n: int, seed: int) -> str:
    """n words of the golden vocabulary, a sentence a line (WikiText-style spacing)."""
    import random

    rng = random.Random(seed)
    lines, words = [], WORDS[2:]
    while n > 0:
        k = min(n, rng.randint(4, 12))
        lines.append(" " + " ".join(rng.choice(words) for _ in range(k)) + " ")
        n -= k
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The scratch directory and environment every block runs in (see the module docstring)."""
    root = tmp_path_factory.mktemp("readme")
    snapshot = root / "hub" / "models--transfo-xl--transfo-xl-wt103" / "snapshots" / COMMIT
    shutil.copytree(GOLDEN, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    (root / "part2.txt").write_text("the cat sat on a mat .\n")
    (root / "my.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    for folder, n in (("my_corpus", 3000), ("my_text", 3000)):
        (root / folder).mkdir()
        for k, split in enumerate(("train", "valid", "test")):
            (root / folder / f"{split}.txt").write_text(_words(n, k))
    wt103 = root / "data" / "wt103" / "wikitext-103"
    wt103.mkdir(parents=True)
    for k, split in enumerate(("train", "valid", "test")):
        (wt103 / f"wiki.{split}.tokens").write_text(" = Valkyria = \n\n" + _words(1500, 10 + k))
    shutil.copyfile(wt103 / "wiki.test.tokens", root / "wiki.test.tokens")
    ptb = root / "data" / "ptb" / "simple-examples" / "data"
    ptb.mkdir(parents=True)
    for k, split in enumerate(("train", "valid", "test")):
        (ptb / f"ptb.{split}.txt").write_text(_words(6000 if split == "train" else 2000, 20 + k))
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(root),
           "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(root / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(root / "hub"), "HF_HOME": str(root / "hf_home"), "PYTHONPATH": str(ROOT / "src"),
           "MPLBACKEND": "Agg", "LANG": "C.UTF-8"}
    return root, env


def _param(block: Block):
    marks = [pytest.mark.slow] if block.slow else []
    return pytest.param(block, marks=marks, id=f"line{block.line}-{block.lang}")


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_readme_block_runs(block, workspace):
    if block.skip:
        pytest.skip(f"README line {block.line}: {block.skip}")
    root, env = workspace
    text = block.text()
    cmd = ["bash", "-euo", "pipefail", "-c", text] if block.lang == "bash" else [sys.executable, "-c", text]
    with serving(block, root, env) as url:
        if url is not None:
            text = text.replace("http://127.0.0.1:8000", url)
            cmd[-1] = text
        result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (f"README line {block.line} failed ({result.returncode}):\n{text}\n"
                                    f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")


@contextlib.contextmanager
def serving(block: Block, root: Path, env: dict):
    """The `txl serve` of a block's ``serve:`` directive, ready (/health 200) at a free port: yields its address
    (None without the directive); stopped with SIGTERM (its drain) afterwards."""
    if block.serve is None:
        yield None
        return
    import signal
    import time
    import urllib.request

    log = root / f"serve-line{block.line}.log"
    argv = [sys.executable, "-m", "txl", "serve", *shlex.split(block.serve), "--port", "0",
            "--serve.state_dir", str(root / f"serve-line{block.line}")]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline, url = time.monotonic() + 300, None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, f"txl serve did not start:\n{log.read_text()}"
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
            try:
                if found and urllib.request.urlopen(found.group(1) + "/health", timeout=5).status == 200:
                    url = found.group(1)
            except OSError:  # not accepting yet, or 503 while the model loads
                pass
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def test_readme_blocks_found_and_directives_parsed():
    """The convention itself: the blocks are found, and a directive the parser does not know is an error."""
    assert len(BLOCKS) >= 8 and {b.lang for b in BLOCKS} == {"bash", "python"}
    assert any(b.subs for b in BLOCKS) and any(b.skip for b in BLOCKS)
    assert parse_directives("\nskip: why\n", 1)["skip"] == "why"
    assert parse_directives(": sub: a => b", 1)["subs"] == [("a", "b")]
    with pytest.raises(AssertionError, match="unknown docs-test directive"):
        parse_directives("skpi: x", 1)


RESOLVE = """
import functools, sys
import txl
missing = []
for name in sys.argv[1:]:
    try:
        functools.reduce(getattr, name.split(".")[1:], txl)
    except AttributeError:
        missing.append(name)
print(" ".join(missing))
"""


NEEDS_EXTRA = {"txl.lmeval": ("lmeval", "lm_eval")}
"""The README's modules that import an extra's package as they load (module: extra, package), which the README's
`pip install -e ".[dev]"` does not install: where the package is missing, a name in such a module is looked up in
the module's source (``defined_in_source``) instead of by importing it (issue 44)."""


def defined_in_source(name: str) -> bool:
    """Whether ``name`` (a module of NEEDS_EXTRA, or a name at its top level) is defined in the module's source."""
    module = next(m for m in NEEDS_EXTRA if name == m or name.startswith(m + "."))
    path = ROOT / "src" / (module.replace(".", "/") + ".py")
    if name == module:
        return path.is_file()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    top |= {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    return name[len(module) + 1:].split(".")[0] in top


def importable_without_extra(name: str) -> bool:
    return not any((name == m or name.startswith(m + ".")) and importlib.util.find_spec(package) is None
                   for m, (_, package) in NEEDS_EXTRA.items())


@pytest.mark.slow  # a subprocess importing every module the README names (28 s loaded)
def test_readme_api_names_exist():
    """Every `txl.a.b` the README names exists after `import txl` alone, as a reader writes it (a fresh process:
    this one has imported the submodules already): txl.generation.FINISHED, txl.checkpoint.latest, ... A name in a
    module that needs an extra the install lacks (NEEDS_EXTRA: `txl.lmeval` without `[lmeval]`) is found in the
    module's source, so the README's `.[dev]` install passes as the full one does."""
    text = README.read_text(encoding="utf-8")
    names = sorted(set(re.findall(r"`(txl(?:\.[A-Za-z_]\w*)+)", text)))
    assert "txl.generation.FINISHED" in names and "txl.lmeval" in names
    assert defined_in_source("txl.lmeval.TxlLM") and not defined_in_source("txl.lmeval.NoSuchName")
    unimported = [n for n in names if not importable_without_extra(n)]
    assert all(defined_in_source(n) for n in unimported), [n for n in unimported if not defined_in_source(n)]
    names = [n for n in names if importable_without_extra(n)]
    out = subprocess.run([sys.executable, "-c", RESOLVE, *names], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert not out.stdout.split(), f"the README names {out.stdout.split()}, which `import txl` alone does not give"


def test_readme_checkpoint_paths_are_spelt_as_training_writes_them():
    from txl.rundir import CKPT_DIR

    text = README.read_text(encoding="utf-8")
    steps = re.findall(rf"{CKPT_DIR}/(step_\d+)", text)
    assert steps and all(re.fullmatch(r"step_\d{8}", s) for s in steps), steps


def test_the_default_jobs_duration_is_stated_alike():
    """The README, `txl train --list-presets` (the preset's expected time) and `txl --help` give the default job
    one duration, on one CPU thread (the default thread count)."""
    from txl.cli import build_parser
    from txl.presets import preset_expected_time

    minutes = re.compile(r"(\d+(?:\.\d+)?)[ -]min(?:ute)?s? on (one CPU thread|[^;,)]*cores?)")
    readme = README.read_text(encoding="utf-8")
    intro = readme[readme.index("## The two commands"):readme.index("Run the tests:")]
    help_text = build_parser().format_help()
    stated = {where: minutes.findall(text) for where, text in (("README", intro), ("--list-presets",
                                                                   preset_expected_time("default")),
                                                                  ("txl --help", " ".join(help_text.split())))}
    assert all(found == [stated["--list-presets"][0]] * len(found) and found for found in stated.values()), stated
    assert stated["--list-presets"][0][1] == "one CPU thread"


def test_the_eval_example_follows_the_readmes_advice():
    """'Choosing the evaluation context' advises --eval.clamp_len = the training mem_len + tgt_len: the example
    that evaluates runs/default (the default job) with a longer memory follows it."""
    from txl.presets import run_config

    text = README.read_text(encoding="utf-8")
    assert "`--eval.clamp_len` = the training `mem_len + tgt_len`" in text
    [clamp] = re.findall(r"^txl eval runs/default .*--eval\.clamp_len (\d+)", text, re.M)
    default = run_config("default")
    assert int(clamp) == default.model.mem_len + default.train.tgt_len


def test_the_readme_speaks_to_its_reader():
    """No words about how the README was written (issue numbers, the session that wrote it): they mean nothing to a
    reader of the project."""
    text = README.read_text(encoding="utf-8")
    found = re.findall(r"[^.\n]*(?:\bissue \d+|\bissues? #?\d+|the session that|today's)[^.\n]*", text, re.I)
    assert not found, found


def test_the_readme_gives_the_suites_fast_subset():
    """The README's fast subset is a marker pytest knows (pyproject's markers), with the whole suite's duration."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index("Run the tests:"):text.index("## Python API")]
    assert re.search(r"python -m pytest -q +# the whole suite: about \d+ minutes", block)
    assert 'python -m pytest -q -m "not slow"' in block
    assert re.search(r'^\s*"slow: ', (ROOT / "pyproject.toml").read_text(), re.M)


def test_what_the_readmes_commands_write_is_ignored_by_git():
    """Run from the checkout, the README's commands leave no untracked file git would offer to add: every -o/--out
    they name, the Python API's saved models, the virtual environment and txl serve's default state directory are
    covered by .gitignore."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    from txl.serve.config import ServeConfig

    text = "\n".join(b.body for b in BLOCKS)
    paths = set(re.findall(r"(?:\s-o|--out)\s+\"?([\w./-]+)", text))
    paths |= set(re.findall(r"save_(?:pretrained|hf)\(model, \"([\w./-]+)\"\)", text))
    paths |= {".venv/bin/python", ServeConfig().state_dir + "/x.safetensors"}
    paths = {p for p in paths if not p.startswith("/")}  # a cluster's shared disk, not the checkout
    assert {"step.pt2", "scores.jsonl", "my-model", ".venv/bin/python"} <= paths, paths
    found = subprocess.run(["git", "check-ignore", "--no-index", *sorted(paths)], cwd=ROOT, capture_output=True,
                           text=True)
    assert found.returncode in (0, 1), found.stderr
    assert set(found.stdout.split()) == paths, f"not ignored: {sorted(paths - set(found.stdout.split()))}"


def test_the_readme_names_the_vocabulary_file_the_published_repository_holds():
    """Where the README lists a Hugging Face transfo-xl model's files, the vocabulary it names first is one the
    published layout holds (the golden copy of it: vocab.pkl, no vocab.txt; the README said `vocab.txt`, issue 44)."""
    held = {p.name for p in GOLDEN.iterdir()}
    assert "vocab.pkl" in held and "vocab.txt" not in held
    text = " ".join(README.read_text(encoding="utf-8").split())
    mentions = re.findall(r"directory of its files \(with ([^;)]*)", text)
    assert mentions, "the README no longer introduces a transfo-xl model's directory of files"
    for mention in mentions:
        first = re.search(r"`(vocab\.\w+)`", mention)
        assert first and first.group(1) in held, mention


def test_the_default_jobs_printed_figures_are_its_tables_default_row():
    """The output the README shows for `txl train` is the table's `txl train` (AVX512, 1 thread) row: valid and test
    bpc and the best step (the block kept figures from before issue 34's arithmetic when the table moved on, issue
    44), and every row of the table is either of the current code or marked stale."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index("What it prints at the end"):text.index("**What reproduces, and where.**")]
    valid = re.search(r"^valid \(best checkpoint, step (\d+);.*bpc (\d\.\d{4}),", block, re.M)
    test = re.search(r"^test \(best checkpoint, step (\d+);.*bpc (\d\.\d{4}),", block, re.M)
    assert valid and test and valid.group(1) == test.group(1)
    rows = [r.split("|")[1:-1] for r in text.splitlines() if re.match(r"\| AVX(512|2)\b", r)]
    assert len(rows) == 4
    default = next(r for r in rows if "`txl train` (the default)" in r[5])
    assert [c.strip() for c in default[2:5]] == [valid.group(2), test.group(2), valid.group(1)]
    for row in rows:
        stale = [c for c in row[2:5] if "(2)" in c]
        assert len(stale) in (0, 3), row  # a row is measured again whole, or marked stale whole
    assert "(2) Stale:" in text
