"""experiments/rl_grid.py: the grid's bookkeeping and report (no training here), and the LSTM baseline's resume."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import ppo_txl, rl_grid


def fake_run(runs, task, agent, seed, returns, step=1000):
    rows = [{"iteration": i + 1, "global_step": (i + 1) * step, "episodes": 4, "return_mean": r, "length_mean": 3,
             "sps": 100.0, "wall_s": i} for i, r in enumerate(returns)]
    path = rl_grid.run_dir(runs, task, agent, seed)
    path.mkdir(parents=True)
    ppo_txl.write_progress(path / "progress.csv", rows)


def test_report_tables_finished_and_running_runs(tmp_path, monkeypatch):
    task = rl_grid.Task("corridor-8", 10_000, agents=("txl", "mlp"), metric="success", group="horizon")
    monkeypatch.setattr(rl_grid, "GRID", (task,))
    runs = tmp_path / "runs"
    for seed, final in zip((0, 1, 2), (1.0, 0.9, 0.8)):
        fake_run(runs, "corridor-8", "txl", seed, [0.5] * 9 + [final], step=1000)
    fake_run(runs, "corridor-8", "mlp", 0, [0.5] * 4)  # still running: 4k of 10k steps
    docs = tmp_path / "docs"
    rl_grid.main(["report", "--runs", str(runs), "--docs", str(docs)])
    text = (docs / "rl.md").read_text()
    # Scores: the mean of the last 5 iterations (10% of 10 is 1, at least 5): (4 x 0.5 + final) / 5.
    scores = [(4 * 0.5 + f) / 5 for f in (1.0, 0.9, 0.8)]
    assert f"| corridor-8 | 10k | {np.mean(scores):.2f} ± {np.std(scores):.2f} |  |  | so far: 0.50 at 4k |" in text
    assert (docs / "rl" / "corridor-8.png").exists() and (docs / "rl" / "horizon.png").exists()
    assert "### Side by side\n\n(no runs yet)" in text
    # A second report replaces its section and keeps the text around it.
    (docs / "rl.md").write_text("intro\n" + text + "\nafter\n")
    rl_grid.main(["report", "--runs", str(runs), "--docs", str(docs)])
    again = (docs / "rl.md").read_text()
    assert again.startswith("intro\n") and again.endswith("\nafter\n") and again.count(rl_grid.BEGIN) == 1


def test_a_run_is_taken_once_and_a_dead_lock_is_taken_over(tmp_path):
    path = tmp_path / "run"
    assert rl_grid.take(path)
    assert not rl_grid.take(path)  # ours, alive
    (path / "lock").write_text("999999999")  # no such process
    assert rl_grid.take(path)
    assert (path / "lock").read_text() == str(os.getpid())


def test_grid_is_sized_and_ordered():
    runs = list(rl_grid.grid_runs())
    assert runs[0][0].name.startswith("corridor") and runs[0][1] == "txl"  # the horizon experiment first
    assert len(runs) == len(set((t.name, a, s) for t, a, s in runs))
    for task in rl_grid.GRID:
        # Equal steps for every agent: a whole number of our rollouts and of RecurrentPPO's (16 x 128).
        assert task.steps % (rl_grid.NUM_ENVS * task.ppo.get("num_steps", 64)) == 0, task.name
        assert task.steps % (rl_grid.NUM_ENVS * 128) == 0, task.name
        rl_grid.ppo_args(Path("runs"), task, "txl", 0)  # the task's settings are valid Args (minibatches divide)


def test_the_documented_commands_start_from_a_fresh_shell():
    """docs/rl.md's commands as a user types them, from the repository root with no PYTHONPATH: each prints its help
    (`python experiments/rl_grid.py` could not import `experiments`)."""
    root = Path(rl_grid.__file__).resolve().parent.parent
    commands = set(re.findall(r"^(python (?:-m experiments\.rl_grid|experiments/ppo_txl\.py)) ",
                              (root / "docs" / "rl.md").read_text(), re.M))
    assert commands == {"python -m experiments.rl_grid", "python experiments/ppo_txl.py"}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for command in sorted(commands):
        argv = [sys.executable, *command.split()[1:], "--help"]
        done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage" in done.stdout, (command, done.stderr[-2000:])


@pytest.mark.slow
def test_lstm_baseline_resumes_where_it_stopped(tmp_path, monkeypatch):
    pytest.importorskip("sb3_contrib")
    monkeypatch.setattr(rl_grid, "NUM_ENVS", 2)
    rl_grid.train_lstm(tmp_path, "corridor-3", 0, 256, save_every=1)
    rl_grid.train_lstm(tmp_path, "corridor-3", 0, 512, save_every=1)
    rows = ppo_txl.read_progress(tmp_path / "progress.csv")
    assert [int(r["global_step"]) for r in rows] == [256, 512]
