"""PPO with a Transformer-XL memory (txl.rl.core), in one file, CleanRL's style.

    python experiments/ppo_txl.py --task corridor-8 --agent txl --total-steps 200000 --run-dir runs/rl/corridor-8-txl

Collects with the step path (each of N environments acts one step at a time, its memory the last M steps of its own
episode), learns with the sequence path (the rollout cut into sequences of seq_len steps, each with the memory it
started from, no gradient into that memory), clipped PPO with GAE, an entropy bonus and a value loss, minibatches of
whole sequences. Agents: 'txl' (Transformer-XL, post-LN), 'gtrxl' (GTrXL: identity-map reordering and GRU gates),
'txl-i' (the reordering without the gates, GTrXL's "TrXL-I" ablation), 'mlp' (no memory). Tasks:
txl.rl.envs.make_task ('corridor-L' needs only numpy; MiniGrid and POPGym the rl extra).

The run directory holds progress.csv (one row per iteration), checkpoint.pt (written atomically every
--checkpoint-every iterations and at the end: model, optimiser, generator, the environments themselves, their current
observations and memories), return.png, and TensorBoard events with --tensorboard. Run the same command again to
continue a stopped run: it resumes from checkpoint.pt and continues exactly as the uninterrupted run would have
(tests/test_rl_ppo.py), trimming progress.csv back to the checkpoint's iteration.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from txl.fileio import atomic_write, write_text
from txl.rl.core import AgentConfig, AgentMemory, TransformerXLCore
from txl.rl.envs import make_task

CSV_FIELDS = ("iteration", "global_step", "episodes", "return_mean", "length_mean", "policy_loss", "value_loss",
              "entropy", "approx_kl", "clipfrac", "sps", "wall_s")


LAYERS = {"txl": "plain", "gtrxl": "gated", "txl-i": "pre_ln"}
"""The core's layer (AgentConfig.layer) of each agent with memory."""


@dataclass(kw_only=True)
class Args:
    run_dir: str
    """Where progress.csv, checkpoint.pt and return.png go (outside git: runs/rl/...)."""
    task: str = "corridor-8"
    agent: Literal["txl", "gtrxl", "txl-i", "mlp"] = "txl"
    attn_type: str = "relative"
    """The core's positional encoding (txl.rl.core)."""
    seed: int = 0
    total_steps: int = 200_000
    """Environment steps (all environments together)."""
    num_envs: int = 16
    num_steps: int = 64
    """Steps each environment takes per iteration (the rollout's length)."""
    seq_len: int = 16
    """T: the rollout is cut into sequences of T steps for learning; must divide num_steps."""
    num_minibatches: int = 4
    update_epochs: int = 4
    lr: float = 3e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_inner: int = 128
    mem_len: int = 8
    gate_bias: float = 2.0
    """GTrXL's b_g (the 'gtrxl' agent): its update gates start at sigmoid(-b_g)."""
    checkpoint_every: int = 10
    """Iterations between checkpoints (and one at the end)."""
    tensorboard: bool = False
    threads: int = 1
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.agent != "mlp" and self.agent not in LAYERS:
            raise ValueError(f"agent={self.agent!r}: choose {', '.join(map(repr, LAYERS))} or 'mlp'")
        if self.num_steps % self.seq_len:
            raise ValueError(f"seq_len={self.seq_len} must divide num_steps={self.num_steps}")
        if (self.num_envs * self.num_steps // self.seq_len) % self.num_minibatches:
            raise ValueError(f"num_minibatches={self.num_minibatches} must divide the {self.num_envs} x "
                             f"{self.num_steps // self.seq_len} sequences of an iteration")


def layer_init(layer: nn.Linear, std: float = math.sqrt(2)) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(nn.Module):
    """Actor and critic heads on a shared body: the Transformer-XL core, or an MLP without memory."""

    def __init__(self, obs_dim: int, n_actions: int, args: Args) -> None:
        super().__init__()
        d = args.d_model
        if args.agent == "mlp":
            self.core = None
            self.body = nn.Sequential(layer_init(nn.Linear(obs_dim, d)), nn.ReLU(),
                                      layer_init(nn.Linear(d, d)), nn.ReLU())
        else:
            self.core = TransformerXLCore(AgentConfig(
                d_input=obs_dim, d_model=d, n_layer=args.n_layer, n_head=args.n_head, d_inner=args.d_inner,
                mem_len=args.mem_len, attn_type=args.attn_type, layer=LAYERS[args.agent],
                gate_bias=args.gate_bias))
        self.actor = layer_init(nn.Linear(d, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(d, 1), std=1.0)

    def initial_memory(self, n: int) -> AgentMemory | None:
        return None if self.core is None else self.core.initial_memory(n)

    def act(self, obs: torch.Tensor, memory: AgentMemory | None, first: torch.Tensor) -> torch.Tensor:
        """One step of N rows: (N, d); the step is written to memory."""
        return self.body(obs) if self.core is None else self.core.step(obs, memory, first)

    def peek(self, obs: torch.Tensor, memory: AgentMemory | None, first: torch.Tensor) -> torch.Tensor:
        """One step of N rows without writing memory (the value of the rollout's next observation): (N, d)."""
        return self.body(obs) if self.core is None else self.core(obs[:, None], memory, first[:, None]).hidden[:, 0]

    def sequence(self, obs: torch.Tensor, memory: AgentMemory | None, first: torch.Tensor) -> torch.Tensor:
        """B sequences of T steps from their memories: (B, T, d)."""
        return self.body(obs) if self.core is None else self.core(obs, memory, first).hidden


def sample(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One action per row, drawn from our generator (a checkpoint keeps its state: resume is exact)."""
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]


def gae(rewards, values, starts, next_value, next_first, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016) over (S, N) tensors; starts[t]: obs t began an episode
    (so step t-1 ended one). Truncated episodes are treated as ended (no bootstrap across them)."""
    S = rewards.size(0)
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(S)):
        nonterminal = 1.0 - (next_first if t == S - 1 else starts[t + 1]).float()
        nxt = next_value if t == S - 1 else values[t + 1]
        delta = rewards[t] + gamma * nxt * nonterminal - values[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv, adv + values


def to_sequences(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(S, N, ...) rollout -> (C*N, T, ...) sequences, C = S / T, row c*N + n the c-th chunk of environment n."""
    S, N = x.shape[:2]
    C = S // seq_len
    x = x.reshape(C, seq_len, N, *x.shape[2:])  # (C, T, N, ...)
    return x.transpose(1, 2).reshape(C * N, seq_len, *x.shape[3:])  # (C*N, T, ...)


class Run:
    """Everything a checkpoint keeps: the agent, optimiser, generator, environments, their observations, memories
    and unfinished episodes' sums, the counters."""

    def __init__(self, args: Args) -> None:
        self.args = args
        torch.manual_seed(args.seed)
        self.envs = make_task(args.task, args.num_envs, args.seed)
        self.agent = Agent(self.envs.obs_dim, self.envs.n_actions, args)
        self.optimizer = torch.optim.Adam(self.agent.parameters(), lr=args.lr, eps=1e-5)
        self.generator = torch.Generator().manual_seed(args.seed)
        obs, _ = self.envs.reset(seed=args.seed)
        self.next_obs = torch.as_tensor(obs, dtype=torch.float32)
        self.next_first = torch.ones(args.num_envs, dtype=torch.bool)
        self.memory = self.agent.initial_memory(args.num_envs)
        self.ep_return = np.zeros(args.num_envs)
        self.ep_length = np.zeros(args.num_envs, dtype=np.int64)
        self.iteration = 0
        self.global_step = 0
        self.wall_s = 0.0

    def state_dict(self) -> dict:
        return {"args": dataclasses.asdict(self.args), "agent": self.agent.state_dict(),
                "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                "envs": pickle.dumps(self.envs), "next_obs": self.next_obs, "next_first": self.next_first,
                "memory": None if self.memory is None else self.memory.state_dict(),
                "ep_return": self.ep_return, "ep_length": self.ep_length, "iteration": self.iteration,
                "global_step": self.global_step, "wall_s": self.wall_s}

    def load_state_dict(self, state: dict) -> None:
        self.agent.load_state_dict(state["agent"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.envs = pickle.loads(state["envs"])
        self.next_obs, self.next_first = state["next_obs"], state["next_first"]
        self.memory = None if state["memory"] is None else AgentMemory.from_state_dict(state["memory"])
        self.ep_return, self.ep_length = state["ep_return"], state["ep_length"]
        self.iteration, self.global_step, self.wall_s = state["iteration"], state["global_step"], state["wall_s"]

    def save(self, path: Path) -> None:
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(buffer.getvalue()))


def collect(run: Run) -> tuple[dict, list[tuple[float, int]]]:
    """One rollout of num_steps steps in every environment with the step path."""
    args, agent = run.args, run.agent
    S, N = args.num_steps, args.num_envs
    buf = {"obs": torch.zeros(S, N, run.envs.obs_dim), "starts": torch.zeros(S, N, dtype=torch.bool),
           "actions": torch.zeros(S, N, dtype=torch.long), "logprobs": torch.zeros(S, N),
           "rewards": torch.zeros(S, N), "values": torch.zeros(S, N)}
    snapshots = []  # the memory each training sequence starts from
    finished = []
    for step in range(S):
        if step % args.seq_len == 0 and run.memory is not None:
            snapshots.append(run.memory.clone())
        buf["obs"][step], buf["starts"][step] = run.next_obs, run.next_first
        with torch.no_grad():
            h = agent.act(run.next_obs, run.memory, run.next_first)
            logits, value = agent.actor(h), agent.critic(h)[:, 0]
        action = sample(logits, run.generator)
        buf["actions"][step], buf["values"][step] = action, value
        buf["logprobs"][step] = torch.log_softmax(logits, -1).gather(1, action[:, None])[:, 0]
        obs, reward, terminated, truncated, _ = run.envs.step(action.numpy())
        done = np.logical_or(terminated, truncated)
        buf["rewards"][step] = torch.as_tensor(reward, dtype=torch.float32)
        run.ep_return += reward
        run.ep_length += 1
        for n in np.flatnonzero(done):
            finished.append((float(run.ep_return[n]), int(run.ep_length[n])))
        run.ep_return[done], run.ep_length[done] = 0.0, 0
        run.next_obs = torch.as_tensor(obs, dtype=torch.float32)
        run.next_first = torch.as_tensor(done)
    with torch.no_grad():
        next_value = agent.critic(agent.peek(run.next_obs, run.memory, run.next_first))[:, 0]
    buf["advantages"], buf["returns"] = gae(buf["rewards"], buf["values"], buf["starts"], next_value,
                                            run.next_first, args.gamma, args.gae_lambda)
    buf["memory"] = AgentMemory.stack(snapshots) if snapshots else None
    return buf, finished


def learn(run: Run, buf: dict) -> dict[str, float]:
    """update_epochs passes over the rollout's sequences in minibatches: clipped PPO loss (Schulman et al. 2017)."""
    args, agent = run.args, run.agent
    seq = {k: to_sequences(v, args.seq_len) for k, v in buf.items() if k != "memory"}  # (B, T, ...) each
    n_seq = seq["obs"].size(0)
    per_batch = n_seq // args.num_minibatches
    stats = []
    for _ in range(args.update_epochs):
        order = torch.randperm(n_seq, generator=run.generator)
        for start in range(0, n_seq, per_batch):
            idx = order[start:start + per_batch]
            memory = None if buf["memory"] is None else buf["memory"].index(idx)
            h = agent.sequence(seq["obs"][idx], memory, seq["starts"][idx])  # (b, T, d)
            logits, value = agent.actor(h), agent.critic(h)[..., 0]  # (b, T, A), (b, T)
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, seq["actions"][idx][..., None])[..., 0]  # (b, T)
            entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
            log_ratio = logp - seq["logprobs"][idx]
            ratio = log_ratio.exp()
            adv = seq["advantages"][idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            value_loss = 0.5 * F.mse_loss(value, seq["returns"][idx])
            loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss
            run.optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            run.optimizer.step()
            with torch.no_grad():
                stats.append((policy_loss.item(), value_loss.item(), entropy.item(),
                              ((ratio - 1) - log_ratio).mean().item(),
                              ((ratio - 1).abs() > args.clip_coef).float().mean().item()))
    mean = np.mean(stats, axis=0)
    return dict(zip(("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"), mean.tolist()))


def read_progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_progress(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, CSV_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, text.getvalue())


def plot_progress(rows: list[dict], path: Path, title: str) -> None:
    """Return against environment steps (skipped without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    xs = [int(r["global_step"]) for r in rows if r["return_mean"] not in ("", "nan")]
    ys = [float(r["return_mean"]) for r in rows if r["return_mean"] not in ("", "nan")]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys)
    ax.set(xlabel="environment steps", ylabel="mean episode return", title=title)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def train(args: Args, stop_after: int | None = None) -> Run:
    """Train (or resume) the run in args.run_dir; ``stop_after``: return after that many iterations of this call."""
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt, progress = run_dir / "checkpoint.pt", run_dir / "progress.csv"
    run = Run(args)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        now = dataclasses.asdict(args)
        if state["args"] != now:
            changed = {k: (v, now.get(k)) for k, v in state["args"].items() if now.get(k) != v}
            if set(changed) - {"run_dir", "total_steps", "checkpoint_every", "quiet", "tensorboard"}:  # where, not what
                raise ValueError(f"{ckpt} was written with other settings {changed}: use another --run-dir")
        run.load_state_dict(state)
    rows = [r for r in read_progress(progress) if int(r["iteration"]) <= run.iteration]
    write_progress(progress, rows)  # rows past the checkpoint are redone
    writer = None
    if args.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(str(run_dir / "tb"))
        except ImportError:
            pass
    per_iteration = args.num_envs * args.num_steps
    iterations = math.ceil(args.total_steps / per_iteration)
    done_here = 0
    while run.iteration < iterations and (stop_after is None or done_here < stop_after):
        t0 = time.perf_counter()
        if args.anneal_lr:
            run.optimizer.param_groups[0]["lr"] = args.lr * (1 - run.iteration / iterations)
        buf, finished = collect(run)
        stats = learn(run, buf)
        run.iteration += 1
        run.global_step += per_iteration
        elapsed = time.perf_counter() - t0
        run.wall_s += elapsed
        returns = [r for r, _ in finished]
        row = {"iteration": run.iteration, "global_step": run.global_step, "episodes": len(finished),
               "return_mean": float(np.mean(returns)) if returns else float("nan"),
               "length_mean": float(np.mean([n for _, n in finished])) if finished else float("nan"),
               **stats, "sps": per_iteration / elapsed, "wall_s": run.wall_s}
        rows.append(row)
        with open(progress, "a", newline="") as f:  # a row per iteration; the checkpoint's rewrite trims a torn tail
            csv.DictWriter(f, CSV_FIELDS).writerow(row)
        if writer is not None:
            for k, v in row.items():
                writer.add_scalar(k, v, run.global_step)
        if not args.quiet:
            print(f"{args.task} {args.agent} seed {args.seed} | it {run.iteration}/{iterations} "
                  f"step {run.global_step} | return {row['return_mean']:.3f} ({len(finished)} ep) | "
                  f"kl {stats['approx_kl']:.4f} ent {stats['entropy']:.3f} | {row['sps']:.0f} steps/s", flush=True)
        done_here += 1
        if run.iteration % args.checkpoint_every == 0 or run.iteration == iterations:
            run.save(ckpt)
            write_progress(progress, rows)
            plot_progress(rows, run_dir / "return.png", f"{args.task}, {args.agent}, seed {args.seed}")
    if writer is not None:
        writer.close()
    return run


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.default is dataclasses.MISSING:
            parser.add_argument(flag, required=True)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    train(parse_args(sys.argv[1:]))
