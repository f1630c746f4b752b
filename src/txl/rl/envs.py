"""Memory tasks for agents: the cue-recall corridor (numpy only) and the gymnasium tasks by name.

Every task is a vector environment with gymnasium's vector interface and its same-step autoreset: ``reset(seed=)``
returns (obs (N, d) float32, info); ``step(actions (N,))`` returns (obs, rewards, terminations, truncations, info),
and a row whose episode ended returns its next episode's first observation in the same call. The PPO
(experiments/ppo_txl.py) reads only that, so it runs the corridor without gymnasium installed.
"""

from __future__ import annotations

from txl.rl.corridor import CorridorVecEnv

__all__ = ["CorridorVecEnv", "make_task"]


def make_task(task: str, num_envs: int, seed: int):
    """A vector environment by name: 'corridor-L' (L its length), a gymnasium id ('MiniGrid-MemoryS7-v0'), or
    'popgym-Name' (``POPGYM``). Observations flattened to float vectors (one-hot for discrete ones; MiniGrid's image
    alone, its mission text is fixed), a Discrete action space; ``obs_dim`` and ``n_actions`` set on the result."""
    if task.startswith("corridor-"):
        try:
            length = int(task.split("-", 1)[1])
        except ValueError:
            raise ValueError(f"task {task!r}: a corridor is named corridor-L, L its length (e.g. corridor-8)") from None
        env = CorridorVecEnv(num_envs, length, seed)
        env.reset(seed=seed)
        return env
    try:
        from txl.rl import gym_tasks
    except ImportError as e:
        raise ImportError(f"task {task!r} needs gymnasium and its task's package: pip install -e '.[rl]'") from e
    return gym_tasks.make_vector(task, num_envs, seed)
