"""Ctrl-C at any moment of start-up is one line and exit 130: `txl train`, `txl generate` and `txl serve` as real
processes started the way the `txl` command starts them, SIGINT sent at several delays (while the command line's
modules import, while torch imports, while the model loads or the corpus is read, once the command runs)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import txl

pytestmark = pytest.mark.slow  # real processes

TINY = ["--preset", "tiny", "--model.n_layer", "1", "--model.d_model", "32", "--model.n_head", "2",
        "--model.d_head", "16", "--model.d_inner", "64", "--model.mem_len", "8", "--train.tgt_len", "8",
        "--train.batch_size", "4", "--train.progress", "false", "--train.tensorboard", "false",
        "--train.plot", "false", "--data.level", "byte", "--max-steps", "100000", "--train.log_interval", "100000"]

# What the `txl` console script does ([project.scripts] txl = "txl.__main__:entry"), after saying it runs: the delays
# count from the moment Python runs our code (before it, in the interpreter's own start and the environment's .pth
# files, Python's handling applies: see txl/__main__.py).
ENTRY = """
import sys
print("UP", flush=True)
from txl.__main__ import entry
sys.argv[0] = "txl"
sys.exit(entry())
"""

DELAYS = [0.1, 0.4, 1.0, 2.5, 5.0]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from serve_util import make_model_dir

    root = tmp_path_factory.mktemp("startup")
    corpus = root / "code.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    return root, corpus, make_model_dir(root / "model")


def command(name, root, corpus, model, n):
    return {"train": ["train", *TINY, "--data.corpus", str(corpus), "--out", str(root / f"run{n}")],
            "generate": ["generate", "--checkpoint", str(model), "--prompt", "The cat", "--max-new-tokens", "100000"],
            "serve": ["serve", str(model), "--port", "0", "--serve.state_dir", str(root / f"state{n}")]}[name]


def interrupt(argv, delay, tmp_path, script=ENTRY):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # SIGINT as a terminal delivers it: a shell without job control starts background jobs with SIGINT ignored.
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *map(str, argv)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "UP"
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def assert_one_line(name, rc, err, delay):
    lines = err.strip().splitlines()
    said = [x for x in lines if "SIGINT" in x]
    assert rc == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err and "never awaited" not in err, \
        f"at {delay} s: exit {rc}\n{err[-3000:]}"
    assert len(said) == 1 and said[0] == lines[-1], f"at {delay} s:\n{err[-3000:]}"
    assert lines[-1].startswith(f"txl {name}: interrupted by SIGINT") or (
        name == "train" and lines[-1].startswith("txl train: stopped by SIGINT")), f"at {delay} s:\n{err[-3000:]}"


@pytest.mark.parametrize("name", ["train", "generate", "serve"])
def test_ctrl_c_at_any_moment_of_start_up_is_one_line_and_130(inputs, tmp_path, name):
    """A server whose model was loaded when the signal came has started: it drains and exits 0 (tests/
    test_serve_process.py), which its log shows ('sessions written' is the engine's, which exists once the model is
    loaded); any other outcome is the start-up's one line and 130."""
    root, corpus, model = inputs
    for n, delay in enumerate(DELAYS):
        rc, err = interrupt(command(name, root, corpus, model, f"{name}{n}"), delay, tmp_path)
        if name == "serve" and rc == 0:
            assert "sessions written" in err and "Traceback" not in err and "SIGINT" not in err, err[-3000:]
            continue
        assert_one_line(name, rc, err, delay)


def test_ctrl_c_while_serve_loads_the_model(inputs, tmp_path):
    """The server listens while the model loads (503 until ready): a Ctrl-C then interrupts the start-up (one
    line, 130) rather than draining a server that never served (exit 0 is for a server that ran)."""
    root, corpus, model = inputs
    script = """
    import sys, time
    import txl.cli.generate as generate
    real = generate.load_model_and_tokenizer
    def slow(*a, **k):
        print("UP", flush=True)  # loading now
        time.sleep(2)
        return real(*a, **k)
    generate.load_model_and_tokenizer = slow
    from txl.__main__ import entry
    sys.argv[0] = "txl"
    sys.exit(entry())
    """
    rc, err = interrupt(command("serve", root, corpus, model, "loading"), 0.2, tmp_path, script)
    assert_one_line("serve", rc, err, "loading")
    assert err.strip().splitlines()[-1] == ("txl serve: interrupted by SIGINT; the server had not started serving; "
                                            "nothing was written")


def test_the_txl_command_runs_the_guarded_entry_point():
    """pyproject's console script is the entry that guards the import of txl.cli (not txl.cli:main)."""
    text = (Path(txl.__file__).parents[2] / "pyproject.toml").read_text()
    assert 'txl = "txl.__main__:entry"' in text
