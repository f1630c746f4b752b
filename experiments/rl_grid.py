"""The memory-task grid of docs/rl.md: Transformer-XL, GTrXL, an LSTM and a memoryless MLP on memory tasks.

    python -m experiments.rl_grid run [--only corridor] [--runs runs/rl]   # runs (or continues) every unfinished run
    python -m experiments.rl_grid report [--runs runs/rl]                  # docs/rl.md's tables and docs/rl/*.png
    python -m experiments.rl_grid speed --task popgym-RepeatPreviousEasy   # env steps/s, ours vs RecurrentPPO

Each run lives in runs/rl/<task>/<agent>-s<seed>/ (progress.csv and a checkpoint); ``run`` skips finished runs and
continues stopped ones where they stopped (ours exactly, from checkpoint.pt; the LSTM from its last model.zip with
fresh environments, see ``train_lstm``), so it can be stopped at any time and started again. Runs go in GRID's order,
the corridor's horizon experiment first, ours before the LSTM's (``grid_runs``). ``report`` reads whatever has
finished (and, marked, what is running).

Agents: 'txl' (Transformer-XL, the paper's post-LN layer), 'gtrxl' (gated, identity-map reordered), 'mlp' (no memory)
are experiments/ppo_txl.py; 'lstm' is sb3-contrib's RecurrentPPO with its documented defaults ('MlpLstmPolicy', an
LSTM of 256, n_steps 128, batch 128, 10 epochs, lr 3e-4, ent_coef 0), on as many environments as ours (16).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import io
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from experiments import ppo_txl
from txl.fileio import atomic_write, write_text

ROOT = Path(__file__).resolve().parent.parent
NUM_ENVS = 16


@dataclass(frozen=True)
class Task:
    name: str
    steps: int
    """Environment steps of every run on this task (all agents alike)."""
    ppo: dict = field(default_factory=dict)
    """Settings of ppo_txl.Args for our agents on this task."""
    seeds: tuple[int, ...] = (0, 1, 2)
    agents: tuple[str, ...] = ("txl", "gtrxl", "lstm", "mlp")
    metric: str = "mean return"
    group: str = "main"


# Our agents' memory: 2 layers of M steps reach 2 M back. The corridor's horizon experiment uses M = 8 (reach 16:
# corridor-L's cue is L - 1 steps before the choice, so L <= 17 is inside); the other tasks M = 32 (reach 64, over
# POPGym's 52-step episodes).
# Steps: multiples of 2048, one rollout of ours (16 envs x 64 or 128 steps) and of RecurrentPPO (16 x 128) alike.
STEPS_CORRIDOR = 74 * 2048  # 151,552
STEPS_LONG = 98 * 2048  # 200,704
LONG = {"mem_len": 32, "num_steps": 128, "seq_len": 32}
# The corridor rewards one decision per episode: 64 in a rollout of corridor-16 (16 x 64 steps), 43 in one of
# corridor-48 (16 x 128). With 4 epochs of 4 minibatches (16 gradient steps a rollout) the plain layer found
# corridor-48's cue in one seed of three (0.93, 0.50, 0.51), and corridor-16's gated seed 2 lost the solved task in
# one update (0.84 ± 0.23). RecurrentPPO's update count, 10 epochs (here of 8 minibatches), squeezes more out of each
# rollout: with it every seed of both layers solves corridor-48 (0.996-1.000) and corridor-16 (1.00) (docs/rl.md).
UPDATES = {"update_epochs": 10, "num_minibatches": 8}
CORRIDOR = {"mem_len": 8, "num_steps": 64, "seq_len": 16, **UPDATES}
SPARSE = {**LONG, **UPDATES}
# RepeatPreviousEasy with LONG's lr of 3e-4: txl 0.95 ± 0.00, gtrxl 0.88 ± 0.05 at 200k steps, the gated seeds 0 and 2
# still climbing; at 6e-4 txl 0.98 ± 0.01, gtrxl 0.99 ± 0.01 (docs/rl.md). 10 epochs of 8 minibatches ended lower
# instead (at 3e-4: txl 0.93 ± 0.02, gtrxl 0.78 ± 0.03).
REPEAT = {**LONG, "lr": 6e-4}
# CountRecall (answer, each step, how often the queried colour has been dealt so far) with LONG's settings learns
# nothing in 200k steps: the policy's entropy stays at log(27). Three changes, the same for txl, gtrxl and the MLP
# (which has no core: only the first applies to it): RecurrentPPO's update count (10 epochs of minibatches of 128
# steps, 160 gradient steps a rollout where LONG takes 16); the episode-index ('absolute') encoding, since a count is
# a fraction of the steps seen times their number, and attention over relative distances is handed no number of
# steps; one layer of M = 64, the whole 51-step episode in one window, so the count is one attention average. Single
# txl runs at 200k steps (docs/rl.md): 2 layers of 32 with the update count, relative -0.86, absolute -0.63; one layer
# of 64, relative -0.90, absolute -0.54 (3 seeds: -0.53).
COUNT = {**LONG, "n_layer": 1, "mem_len": 64, "update_epochs": 10, "num_minibatches": 16, "attn_type": "absolute"}
# Every agent was still climbing at 200,704 steps on CountRecall (txl -0.53 ± 0.01, gtrxl -0.62 ± 0.02, the LSTM
# -0.56 ± 0.05): the task gets twice the steps, all four agents alike (docs/rl.md, "Settings changed after a first
# grid").
STEPS_COUNT = 2 * STEPS_LONG  # 401,408
GRID = (
    # The horizon: inside (8, 16) and beyond (24, 32) 2 x M = 16, txl and the MLP first; then its edge, 17 (the cue
    # exactly 16 back, one path: layer 1 at step 16 reads step 8, whose layer 0 reads step 0) and 18 (out of reach).
    *(Task(f"corridor-{n}", STEPS_CORRIDOR, CORRIDOR, agents=("txl", "mlp"), metric="success", group="horizon")
      for n in (8, 16, 24, 32)),
    *(Task(f"corridor-{n}", STEPS_CORRIDOR, CORRIDOR, agents=("txl",), metric="success", group="horizon")
      for n in (17, 18)),
    Task("corridor-1", 20 * 2048, CORRIDOR, agents=("mlp",), metric="success", group="horizon"),
    # The side-by-side table.
    Task("corridor-16", STEPS_CORRIDOR, CORRIDOR, agents=("gtrxl", "lstm"), metric="success", group="horizon"),
    Task("corridor-48", STEPS_LONG, SPARSE, metric="success"),
    Task("popgym-RepeatPreviousEasy", STEPS_LONG, REPEAT),
    Task("popgym-CountRecallEasy", STEPS_COUNT, COUNT),
    Task("MiniGrid-MemoryS7-v0", STEPS_LONG, LONG, seeds=(0, 1)),
)


def run_dir(runs: Path, task: str, agent: str, seed: int) -> Path:
    return runs / task / f"{agent}-s{seed}"


def finished(path: Path, steps: int) -> bool:
    rows = ppo_txl.read_progress(path / "progress.csv")
    return bool(rows) and int(rows[-1]["global_step"]) >= steps


def ppo_args(runs: Path, task: Task, agent: str, seed: int) -> ppo_txl.Args:
    return ppo_txl.Args(run_dir=str(run_dir(runs, task.name, agent, seed)), task=task.name, agent=agent, seed=seed,
                        total_steps=task.steps, num_envs=NUM_ENVS, quiet=True, **task.ppo)


# -- the LSTM baseline: sb3-contrib's RecurrentPPO ----------------------------------------------------------------


def train_lstm(path: Path, task: str, seed: int, total_steps: int, save_every: int = 10) -> None:
    """RecurrentPPO('MlpLstmPolicy') with its defaults on NUM_ENVS environments, progress.csv rows as ours (one per
    rollout), model.zip every ``save_every`` rollouts. A stopped run continues from its last model.zip (weights,
    optimiser, step count) with fresh environments and LSTM states: where it stopped, not bit for bit."""
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    from txl.rl import gym_tasks

    torch.set_num_threads(1)
    path.mkdir(parents=True, exist_ok=True)
    model_path, progress = path / "model.zip", path / "progress.csv"
    env = make_vec_env(functools.partial(gym_tasks.make_one, task), n_envs=NUM_ENVS, seed=seed)
    if model_path.exists():
        model = RecurrentPPO.load(model_path, env=env, device="cpu")
    else:
        model = RecurrentPPO("MlpLstmPolicy", env, seed=seed, device="cpu")
    rows = [r for r in ppo_txl.read_progress(progress) if int(r["global_step"]) <= model.num_timesteps]
    ppo_txl.write_progress(progress, rows)

    def save() -> None:
        buffer = io.BytesIO()
        model.save(buffer)
        atomic_write(model_path, lambda tmp: Path(tmp).write_bytes(buffer.getvalue()))
        ppo_txl.write_progress(progress, rows)

    class Progress(BaseCallback):
        def _on_training_start(self) -> None:
            self.returns, self.lengths, self.t0 = [], [], time.perf_counter()
            self.last_step, self.cycled = self.num_timesteps, False

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:  # sb3's Monitor, at an episode's end
                    self.returns.append(info["episode"]["r"])
                    self.lengths.append(info["episode"]["l"])
            return True

        def _on_rollout_end(self) -> None:
            # The rollout just collected and the update before it (sb3 updates after each rollout, we after each
            # collection): steps/s over collect + learn, as ours.
            now = time.perf_counter()
            wall = float(rows[-1]["wall_s"]) if rows else 0.0
            # The first rollout of a learn() call had no update before it: no steps/s of the whole cycle.
            sps = (self.num_timesteps - self.last_step) / (now - self.t0) if self.cycled else ""
            self.cycled = True
            row = {"iteration": len(rows) + 1, "global_step": self.num_timesteps, "episodes": len(self.returns),
                   "return_mean": float(np.mean(self.returns)) if self.returns else float("nan"),
                   "length_mean": float(np.mean(self.lengths)) if self.lengths else float("nan"),
                   "sps": sps, "wall_s": wall + now - self.t0}
            rows.append(row)
            with open(progress, "a", newline="") as f:
                csv.DictWriter(f, ppo_txl.CSV_FIELDS).writerow(row)
            self.returns, self.lengths, self.t0, self.last_step = [], [], now, self.num_timesteps
            if len(rows) % save_every == 0:
                save()

    remaining = total_steps - model.num_timesteps
    if remaining > 0:
        model.learn(total_timesteps=remaining, reset_num_timesteps=False, callback=Progress())
    save()
    env.close()


def run_one(runs: Path, task: Task, agent: str, seed: int) -> None:
    path = run_dir(runs, task.name, agent, seed)
    if agent == "lstm":
        train_lstm(path, task.name, seed, task.steps)
    else:
        ppo_txl.train(ppo_args(runs, task, agent, seed))
        rows = ppo_txl.read_progress(path / "progress.csv")
        ppo_txl.plot_progress(rows, path / "return.png", f"{task.name}, {agent}, seed {seed}")


def grid_runs(only: str | None = None):
    """(task, agent, seed) in the order ``run`` takes them: ours on every task first (minutes a run), then the LSTM
    runs (hours a run: RecurrentPPO runs ~1/20 of our speed), each in GRID's order."""
    tasks = [t for t in GRID if not only or only in t.name]
    for lstm in (False, True):
        for task in tasks:
            for seed in task.seeds:
                for agent in task.agents:
                    if (agent == "lstm") == lstm:
                        yield task, agent, seed


def take(path: Path) -> bool:
    """Claim a run for this process (a lock file holding our pid): False when a live process holds it, so that two
    ``run`` workers share the grid. A lock left by a dead process is taken over."""
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(lock.read_text() or 0), 0)
            return False  # alive
        except (ProcessLookupError, ValueError):
            lock.unlink(missing_ok=True)
            return take(path)
        except PermissionError:
            return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def cmd_run(args) -> None:
    runs = Path(args.runs)
    for task, agent, seed in grid_runs(args.only):
        path = run_dir(runs, task.name, agent, seed)
        if finished(path, task.steps) or not take(path):
            continue
        try:
            print(f"{time.strftime('%H:%M:%S')} {task.name} {agent} seed {seed} -> {path}", flush=True)
            run_one(runs, task, agent, seed)
        finally:
            (path / "lock").unlink(missing_ok=True)


# -- the report -----------------------------------------------------------------------------------------------------


def final_score(rows: list[dict]) -> float:
    """Mean episode return over the last 10% of a run's environment steps (at least its last 5 iterations)."""
    keep = max(5, math.ceil(len(rows) / 10))
    values = [float(r["return_mean"]) for r in rows[-keep:] if r["return_mean"] not in ("", "nan")]
    return float(np.mean(values)) if values else float("nan")


def collect_results(runs: Path) -> list[dict]:
    out = []
    for task, agent, seed in grid_runs():
        rows = ppo_txl.read_progress(run_dir(runs, task.name, agent, seed) / "progress.csv")
        if not rows:
            continue
        done = int(rows[-1]["global_step"]) >= task.steps
        sps = [float(r["sps"]) for r in rows if r["sps"]]
        out.append({"task": task, "agent": agent, "seed": seed, "rows": rows, "done": done,
                    "score": final_score(rows), "steps": int(rows[-1]["global_step"]),
                    "sps": float(np.median(sps)) if sps else float("nan")})
    return out


def unique_tasks(results: list[dict], group: str | None = None) -> list[Task]:
    """The grid's tasks with results, one per name (a task may be listed twice, its agents split between the
    horizon experiment and the side-by-side runs), in the grid's order."""
    names = {r["task"].name for r in results}
    out = {}
    for t in GRID:
        if t.name in names and (group is None or t.group == group):
            out.setdefault(t.name, t)
    # The corridors by length, the other tasks in GRID's order after them.
    return sorted(out.values(), key=lambda t: int(t.name.split("-")[1]) if t.name.startswith("corridor-") else 10**9)


def table(results: list[dict], group: str) -> str:
    agents = ("txl", "gtrxl", "lstm", "mlp")
    if not unique_tasks(results, group):
        return "(no runs yet)"
    lines = ["| task | steps | " + " | ".join(agents) + " |", "|---|---|" + "---|" * len(agents)]
    for task in unique_tasks(results, group):
        cells = []
        for agent in agents:
            got = [r for r in results if r["task"].name == task.name and r["agent"] == agent]
            done = [r["score"] for r in got if r["done"]]
            if not got:
                cells.append("")
            elif done:
                spread = f" ± {np.std(done):.2f}" if len(done) > 1 else ""
                seeds = f" ({len(done)} of {len(task.seeds)} seeds)" if len(done) < len(task.seeds) else ""
                cells.append(f"{np.mean(done):.2f}{spread}{seeds}")
            else:
                cells.append("so far: " + ", ".join(f"{r['score']:.2f} at {r['steps'] // 1000}k" for r in got))
        lines.append(f"| {task.name} | {task.steps // 1000}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_task(results: list[dict], task: Task, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for i, agent in enumerate(("txl", "gtrxl", "lstm", "mlp")):
        label = agent  # on its first seed's line only
        for r in (r for r in results if r["task"].name == task.name and r["agent"] == agent):
            pts = [(int(x["global_step"]), float(x["return_mean"])) for x in r["rows"]
                   if x["return_mean"] not in ("", "nan")]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=f"C{i}", alpha=0.7, lw=1, label=label)
                label = None
    ax.set(xlabel="environment steps", ylabel=task.metric, title=task.name)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)


def plot_horizon(results: list[dict], path: Path) -> None:
    """Final success against corridor length, a point per finished seed and the mean per agent; the reach L x M."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for i, agent in enumerate(("txl", "gtrxl", "lstm", "mlp")):
        got = [r for r in results if r["task"].name.startswith("corridor-") and r["agent"] == agent and r["done"]]
        if not got:
            continue
        lengths = sorted({int(r["task"].name.split("-")[1]) for r in got})
        ax.scatter([int(r["task"].name.split("-")[1]) for r in got], [r["score"] for r in got], color=f"C{i}", s=12,
                   alpha=0.6)
        ax.plot(lengths, [np.mean([r["score"] for r in got if r["task"].name == f"corridor-{n}"]) for n in lengths],
                color=f"C{i}", label=agent)
    reach = CORRIDOR["mem_len"] * 2
    ax.axvline(reach + 1.5, color="grey", ls="--", lw=1, label=f"reach: L - 1 <= {reach}")
    ax.set(xlabel="corridor length L (cue L - 1 steps before the choice)", ylabel="success",
           title="Horizon: 2 layers x M = 8")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)


BEGIN, END = "<!-- rl_grid report: begin -->", "<!-- rl_grid report: end -->"


def cmd_report(args) -> None:
    runs = Path(args.runs)
    results = collect_results(runs)
    parts = ["Score: mean episode return over the last 10% of each run's environment steps (corridor: the success "
             "rate), mean ± standard deviation over seeds; a cell with no finished run shows each seed's score so "
             "far.", "",
             "### The corridor's horizon (2 layers x M = 8: reach 16 steps)", "", table(results, "horizon"), "",
             "### Side by side", "", table(results, "main"), "", "Median env steps/s of each agent (one thread, the "
             "busy shared 2-core machine, each run's own iterations):", "",
             "| task | " + " | ".join(("txl", "gtrxl", "lstm", "mlp")) + " |", "|---|---|---|---|---|"]
    present = unique_tasks(results)
    for task in present:
        cells = []
        for agent in ("txl", "gtrxl", "lstm", "mlp"):
            sps = [r["sps"] for r in results
                   if r["task"].name == task.name and r["agent"] == agent and not math.isnan(r["sps"])]
            cells.append(f"{np.median(sps):.0f}" if sps else "")
        parts.append(f"| {task.name} | " + " | ".join(cells) + " |")
    parts.append("")
    if any(r["task"].group == "horizon" and r["done"] for r in results):
        plot_horizon(results, Path(args.docs) / "rl" / "horizon.png")
        parts.append("![the horizon: success against corridor length](rl/horizon.png)")
    for task in present:
        png = Path(args.docs) / "rl" / f"{task.name}.png"
        plot_task(results, task, png)
        parts.append(f"![{task.name}](rl/{png.name})")
    doc = Path(args.docs) / "rl.md"
    text = doc.read_text() if doc.exists() else f"# Reinforcement learning\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    write_text(doc, head + BEGIN + "\n" + "\n".join(parts) + "\n" + END + tail)
    print(f"wrote {doc} ({len(results)} runs, {sum(r['done'] for r in results)} finished)")


# -- speed: ours against RecurrentPPO, interleaved ----------------------------------------------------------------


def cmd_speed(args) -> None:
    task = next((t for t in GRID if t.name == args.task), None) or Task(args.task, args.steps, LONG)
    task = dataclasses.replace(task, steps=args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        figures: dict[str, list[float]] = {}
        for round_ in range(args.rounds):
            for agent in args.agents.split(","):
                path = Path(tmp) / f"{agent}-{round_}"
                t0 = time.perf_counter()
                if agent == "lstm":
                    train_lstm(path, task.name, 0, task.steps, save_every=10**9)
                else:
                    ppo_txl.train(dataclasses.replace(ppo_args(Path(tmp), task, agent, 0), run_dir=str(path),
                                                      checkpoint_every=10**9))
                steps = int(ppo_txl.read_progress(path / "progress.csv")[-1]["global_step"])
                figures.setdefault(agent, []).append(steps / (time.perf_counter() - t0))
                shutil.rmtree(path)
                print(f"round {round_} {agent}: {figures[agent][-1]:.0f} env steps/s", flush=True)
    print(f"{task.name}, {args.steps} steps a run, {args.rounds} interleaved rounds, OMP_NUM_THREADS=1:")
    for agent, values in figures.items():
        print(f"  {agent}: median {np.median(values):.0f} env steps/s (runs: {', '.join(f'{v:.0f}' for v in values)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--runs", default=str(ROOT / "runs" / "rl"))
    p.add_argument("--only", help="only tasks whose name contains this")
    p = sub.add_parser("report")
    p.add_argument("--runs", default=str(ROOT / "runs" / "rl"))
    p.add_argument("--docs", default=str(ROOT / "docs"))
    p = sub.add_parser("speed")
    p.add_argument("--task", default="popgym-RepeatPreviousEasy")
    p.add_argument("--steps", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--agents", default="txl,lstm")
    args = parser.parse_args(argv)
    {"run": cmd_run, "report": cmd_report, "speed": cmd_speed}[args.cmd](args)


if __name__ == "__main__":
    main(sys.argv[1:])
