"""Transformer-XL as an agent's memory (``txl.rl.core``), a PPO that trains it (``txl.rl.ppo``) and memory tasks
(``txl.rl.envs``). The core needs only torch; the PPO's gymnasium tasks need the ``rl`` extra."""

from txl.rl.core import AgentConfig, AgentMemory, CoreOutput, GRUGate, TransformerXLCore, episode_masks

__all__ = ["AgentConfig", "AgentMemory", "CoreOutput", "GRUGate", "TransformerXLCore", "episode_masks"]
