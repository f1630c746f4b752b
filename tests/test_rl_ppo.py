"""experiments/ppo_txl.py and the corridor task (torch and numpy only; the gymnasium task is skipped without it)."""

import csv

import numpy as np
import pytest
import torch

from experiments import ppo_txl
from txl.rl.envs import CorridorVecEnv, make_task


def test_corridor_rewards_the_cue_at_the_last_step_and_resets_in_the_same_step():
    env = CorridorVecEnv(2, 3, seed=0)
    obs, _ = env.reset(seed=0)
    cue = env.cue.copy()
    assert obs[np.arange(2), cue].tolist() == [1.0, 1.0] and obs[:, 2:].sum() == 0
    obs, r, term, trunc, _ = env.step(np.zeros(2, dtype=np.int64))
    assert obs.tolist() == [[0, 0, 1, 0]] * 2 and r.sum() == 0 and not term.any() and not trunc.any()
    obs, r, term, _, _ = env.step(np.zeros(2, dtype=np.int64))
    assert obs.tolist() == [[0, 0, 1, 1]] * 2 and not term.any()  # the choice step
    obs, r, term, _, _ = env.step(np.array([cue[0], 1 - cue[1]]))
    assert r.tolist() == [1.0, 0.0] and term.all()
    assert obs[np.arange(2), env.cue].tolist() == [1.0, 1.0]  # the next episode's cue, in the same step
    one = CorridorVecEnv(1, 1, seed=0)
    obs, _ = one.reset(seed=1)
    assert obs[0, 3] == 1.0 and obs[0, one.cue[0]] == 1.0  # length 1: cue and choice in one observation
    with pytest.raises(ValueError, match="corridor length=0"):
        CorridorVecEnv(1, 0)
    with pytest.raises(ValueError, match="corridor-L"):
        make_task("corridor-x", 1, 0)


def test_gae_by_hand():
    # One env, 3 steps, an episode ending after step 1 (obs 2 starts a new one).
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [0.25], [1.0]])
    starts = torch.tensor([[True], [False], [True]])
    adv, ret = ppo_txl.gae(rewards, values, starts, torch.tensor([2.0]), torch.tensor([False]), 0.9, 0.5)
    d2 = 3.0 + 0.9 * 2.0 - 1.0
    d1 = 2.0 - 0.25  # the episode ends: no bootstrap
    d0 = 1.0 + 0.9 * 0.25 - 0.5
    expected = torch.tensor([[d0 + 0.45 * d1], [d1], [d2]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_sequences_are_chunks_of_one_environment():
    x = torch.arange(4 * 2).view(4, 2)  # (S=4, N=2): x[s, n] = 2 s + n
    seq = ppo_txl.to_sequences(x, 2)
    assert seq.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # row c*N + n: chunk c of env n


def small_args(tmp_path, name, **kw):
    base = dict(run_dir=str(tmp_path / name), task="corridor-3", agent="txl", num_envs=4, num_steps=16, seq_len=8,
                num_minibatches=2, update_epochs=2, total_steps=4 * 16 * 4, d_model=16, n_head=2, d_inner=32,
                mem_len=4, checkpoint_every=1, quiet=True)
    base.update(kw)
    return ppo_txl.Args(**base)


def rows_without_timing(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in ("sps", "wall_s")} for r in csv.DictReader(f)]


@pytest.mark.parametrize("agent,task", [("txl", "corridor-3"), ("gtrxl", "corridor-3"), ("mlp", "corridor-3"),
                                        ("txl", "popgym-RepeatPreviousEasy")])
def test_checkpoint_resume_is_exact(tmp_path, agent, task):
    if not task.startswith("corridor"):
        pytest.importorskip("gymnasium")
        pytest.importorskip("popgym")
    whole = ppo_txl.train(small_args(tmp_path, "whole", agent=agent, task=task))
    ppo_txl.train(small_args(tmp_path, "parts", agent=agent, task=task), stop_after=2)
    # A torn tail: a row past the checkpoint (the process died before its next one) is redone, not kept.
    with open(tmp_path / "parts" / "progress.csv", "a") as f:
        f.write("3,999,0,0,0,0,0,0,0,0,0,0\n")
    resumed = ppo_txl.train(small_args(tmp_path, "parts", agent=agent, task=task))
    assert resumed.iteration == whole.iteration == 4
    for (name, a), b in zip(whole.agent.state_dict().items(), resumed.agent.state_dict().values()):
        assert torch.equal(a, b), name
    assert rows_without_timing(tmp_path / "whole" / "progress.csv") == rows_without_timing(
        tmp_path / "parts" / "progress.csv")
    assert torch.equal(whole.next_obs, resumed.next_obs)


def test_resume_refuses_other_settings(tmp_path):
    ppo_txl.train(small_args(tmp_path, "a"), stop_after=1)
    with pytest.raises(ValueError, match="other settings .*'mem_len': \\(4, 5\\)"):
        ppo_txl.train(small_args(tmp_path, "a", mem_len=5))
    # A run directory moved elsewhere is the same run: it continues there.
    (tmp_path / "a").rename(tmp_path / "b")
    assert ppo_txl.train(small_args(tmp_path, "b")).iteration == 4


def test_args_are_checked():
    with pytest.raises(ValueError, match="seq_len=5 must divide num_steps=16"):
        ppo_txl.Args(run_dir="x", num_steps=16, seq_len=5)
    with pytest.raises(ValueError, match="agent='lstm': choose 'txl', 'gtrxl', 'txl-i' or 'mlp'"):
        ppo_txl.Args(run_dir="x", agent="lstm")
    # Each agent with memory builds its layer.
    for agent, layer in ppo_txl.LAYERS.items():
        net = ppo_txl.Agent(3, 2, ppo_txl.Args(run_dir="x", agent=agent, gate_bias=1.5))
        assert net.core.config.layer == layer and net.core.config.gate_bias == 1.5


@pytest.mark.slow
def test_short_corridor_is_learned_with_memory_and_not_without(tmp_path):
    """corridor-4 (cue 3 steps back, inside 2 layers x M=4): txl solves it in 16k steps; the MLP stays at chance."""
    kw = dict(task="corridor-4", num_envs=16, num_steps=32, seq_len=16, num_minibatches=4, update_epochs=4,
              total_steps=16 * 32 * 32, d_model=32, n_head=2, d_inner=64, mem_len=4, checkpoint_every=100)
    ppo_txl.train(small_args(tmp_path, "txl", **kw))
    ppo_txl.train(small_args(tmp_path, "mlp", agent="mlp", **kw))
    last = {}
    for name in ("txl", "mlp"):
        rows = ppo_txl.read_progress(tmp_path / name / "progress.csv")
        last[name] = np.mean([float(r["return_mean"]) for r in rows[-4:]])
    assert last["txl"] >= 0.95, last
    assert abs(last["mlp"] - 0.5) < 0.1, last


def test_the_single_gymnasium_corridor_matches_the_vector_one():
    pytest.importorskip("gymnasium")
    from txl.rl.gym_tasks import Corridor

    one, vec = Corridor(3), CorridorVecEnv(1, 3)
    obs, _ = one.reset(seed=5)
    vobs, _ = vec.reset(seed=5)
    for step in range(9):
        assert np.array_equal(obs, vobs[0])
        action = step % 2
        obs, reward, terminated, truncated, _ = one.step(action)
        vobs, vreward, vterminated, _, _ = vec.step(np.array([action]))
        assert (reward, terminated, truncated) == (vreward[0], vterminated[0], False)
        if terminated:
            obs, _ = one.reset()
