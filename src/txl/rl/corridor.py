"""The cue-recall corridor as a vector environment (numpy only): see ``CorridorVecEnv``."""

from __future__ import annotations

from typing import Any

import numpy as np


class CorridorVecEnv:
    """Cue recall along a corridor of ``length`` steps (the T-maze of Bakker 2001, as in Memory Gym's mortar tasks):
    the first observation shows one of two cues, the middle ones only that the agent is in the corridor, the last one
    that it must choose; choosing the cue's action at the last step gives reward 1, anything else 0. Actions before
    the last step do nothing. Recalling the cue needs memory reaching ``length - 1`` steps back; with length 1 the
    cue and the choice are one observation (a memoryless policy solves it). Chance: 0.5.

    Observation (4,): [cue 0, cue 1, in the corridor, choose now]; the last step of a length-1 corridor shows the cue
    and 'choose now' together. Actions: Discrete(2).
    """

    obs_dim = 4
    n_actions = 2

    def __init__(self, num_envs: int, length: int, seed: int = 0) -> None:
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"corridor length={length!r} must be an integer >= 1")
        self.num_envs, self.length = num_envs, length
        self.rng = np.random.default_rng(seed)
        self.cue = np.zeros(num_envs, dtype=np.int64)
        self.pos = np.zeros(num_envs, dtype=np.int64)

    def _observe(self) -> np.ndarray:
        obs = np.zeros((self.num_envs, 4), dtype=np.float32)
        first = self.pos == 0
        obs[first, self.cue[first]] = 1.0
        obs[~first, 2] = 1.0
        obs[self.pos == self.length - 1, 3] = 1.0
        return obs

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.cue = self.rng.integers(0, 2, self.num_envs)
        self.pos[:] = 0
        return self._observe(), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        actions = np.asarray(actions)
        done = self.pos == self.length - 1
        rewards = (done & (actions == self.cue)).astype(np.float32)
        self.pos += 1
        # Same-step autoreset: finished rows start their next episode now.
        self.pos[done] = 0
        self.cue[done] = self.rng.integers(0, 2, int(done.sum()))
        return self._observe(), rewards, done.copy(), np.zeros(self.num_envs, dtype=bool), {}

    def close(self) -> None:
        pass
