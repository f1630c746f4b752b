"""The gymnasium tasks of ``txl.rl.envs.make_task``: MiniGrid and POPGym as vector environments (the ``rl`` extra)."""

from __future__ import annotations

import functools
import importlib

import gymnasium as gym
import numpy as np

from txl.rl.corridor import CorridorVecEnv

POPGYM = {"RepeatPreviousEasy": "popgym.envs.repeat_previous:RepeatPreviousEasy",
          "CountRecallEasy": "popgym.envs.count_recall:CountRecallEasy"}


class FlatObservation(gym.ObservationWrapper):
    """Any observation space flattened to a float32 vector (one-hot for discrete parts). Ours, where gymnasium's
    FlattenObservation holds a lambda: a vector env of these pickles, so a checkpoint can keep it."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        flat = gym.spaces.flatten_space(env.observation_space)
        self.observation_space = gym.spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32),
                                                dtype=np.float32)

    def observation(self, observation):
        return gym.spaces.flatten(self.env.observation_space, observation).astype(np.float32)


class Corridor(gym.Env):
    """``txl.rl.envs.CorridorVecEnv`` as one gymnasium environment (for libraries that make their own vector envs:
    sb3's RecurrentPPO): the same observations, rewards and episode ends."""

    def __init__(self, length: int) -> None:
        self.inner = CorridorVecEnv(1, length)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (CorridorVecEnv.obs_dim,), np.float32)
        self.action_space = gym.spaces.Discrete(CorridorVecEnv.n_actions)
        self.ready = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None or not self.ready:
            # A new stream; else the next episode the inner env began when the last one ended (the same draws).
            self.inner.reset(seed=seed)
        self.ready = False
        return self.inner._observe()[0], {}

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.inner.step(np.array([action]))
        # The inner env has begun the next episode already (same-step autoreset): reset() will hand it out. The
        # observation after the last step is unused (the episode has terminated).
        self.ready = bool(terminated[0])
        return (np.zeros(4, np.float32) if self.ready else obs[0]), float(reward[0]), self.ready, False, {}


def make_one(task: str) -> gym.Env:
    """One environment of ``task`` with a flat float observation (MiniGrid: its image alone; the mission is fixed)."""
    if task.startswith("corridor-"):
        return Corridor(int(task.split("-", 1)[1]))
    if task.startswith("popgym-"):
        module, cls = POPGYM[task.split("-", 1)[1]].split(":")
        env = getattr(importlib.import_module(module), cls)()
    elif task.startswith("MiniGrid-"):
        import minigrid.wrappers  # registers the MiniGrid ids

        env = minigrid.wrappers.ImgObsWrapper(gym.make(task))
    else:
        env = gym.make(task)
    return FlatObservation(env)


def make_vector(task: str, num_envs: int, seed: int) -> gym.vector.SyncVectorEnv:
    """``num_envs`` copies of ``task`` with same-step autoreset, reset with ``seed``; ``obs_dim`` and ``n_actions``
    set on the result."""
    if task.startswith("popgym-") and task.split("-", 1)[1] not in POPGYM:
        raise ValueError(f"task {task!r}: known POPGym tasks are {', '.join('popgym-' + n for n in POPGYM)}")
    # functools.partial of a module-level function, not a closure: the vector env pickles.
    env = gym.vector.SyncVectorEnv([functools.partial(make_one, task) for _ in range(num_envs)],
                                   autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    if not isinstance(env.single_action_space, gym.spaces.Discrete):
        raise ValueError(f"task {task!r} has action space {env.single_action_space}; the PPO handles Discrete ones")
    env.obs_dim = int(np.prod(env.single_observation_space.shape))
    env.n_actions = int(env.single_action_space.n)
    env.reset(seed=seed)
    return env
