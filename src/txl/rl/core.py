"""Transformer-XL as an agent's memory: observation vectors in, hidden states out, one step or a rollout at a time.

Shape legend: N environments (rows) acting together, B rows of a training batch, T steps of a sequence, M memory
length (steps kept per layer), K = M + T keys, L layers, H heads, D head width, d d_model, P learned positions.

Each layer l keeps, per row, the inputs h^(l-1) of the last M steps of that row's episode (Dai et al. 2019, section
3.2: the cached states of the previous segment, stop-gradient). A query sees itself and the M steps before it, no
further and never across an episode start, so acting one step at a time and training on a stored rollout compute
the same function: the sequence path is the step path's sliding window of M + 1 keys, masked per row. With L layers
the agent reaches back L x M steps (each layer extends the previous one's reach by M, the paper's O(N x L) context).

The layer is written here plainly, with the paper's equations, so that the agent depends on no internals of
``txl.model`` (which is tuned for language-model segments) beyond its pure helpers ``positions.sinusoid`` and
``rotary.rotate_window``; tests/test_rl_core.py checks the plain layer against ``txl.model.attention``. Three
layer kinds (Parisotto et al. 2020, "Stabilizing Transformers for RL", GTrXL):

* ``'plain'``: Transformer-XL's post-LN layer, y = LN(x + Attn(x)), out = LN(y + FF(y));
* ``'pre_ln'``: the identity-map reordering (TrXL-I), y = x + ReLU(Attn(LN(x))), out = y + ReLU(FF(LN(y)));
* ``'gated'``: GTrXL, TrXL-I with each residual add replaced by a GRU-type gate g(x, y) whose update gate starts
  biased shut (``gate_bias``, the paper's b_g = 2), so each layer begins near the identity map.

Positional encodings (``AgentConfig.attn_type``, the names of ``txl.config.AttnType``):

* ``'relative'``: Dai et al.'s terms (a)+(b)+(c)+(d), sinusoid R of the distance, W_kR, biases u and v per layer;
* ``'shaw'``: a learned embedding and bias per relative distance (distances beyond P share the farthest);
* ``'rotary'``: queries and keys rotated by their index in the window (Su et al. 2021);
* ``'absolute'``: the sinusoid of the step's index in its episode added to the first layer's input;
* ``'al_rfou'``: a learned embedding of the episode index added to every layer's input (beyond P: the last).

The absolute encodings index a step by its place in its episode, not in the attention window (as the language model
does): the window moves every step an agent acts, and an index into it would change every cached state's meaning
each step (the incoherence section 3.3 of the paper removes); the episode index is fixed for a step's lifetime.

Example: acting with 8 environments, then training on the rollout::

    core = TransformerXLCore(AgentConfig(d_input=obs_dim, d_model=64, n_layer=2, mem_len=16, layer="gated"))
    memory = core.initial_memory(8)                          # every row empty
    snapshot = memory.clone()                                # what the rollout starts from (stop-gradient)
    for t in range(T):
        h = core.step(obs[t], memory, first[t])              # (8, d); memory written in place
    out = core(torch.stack(obs, 1), snapshot, torch.stack(first, 1)).hidden  # (8, T, d), the same h's

``first[t]`` (N,) bool marks rows whose episode starts at step t (their memory is emptied first); ``memory.reset(rows)``
empties rows directly. Both paths give the same outputs to 1e-5 (tests/test_rl_core.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import AttnType
from txl.model.positions import sinusoid
from txl.model.rotary import rotate_window

LayerKind = Literal["plain", "pre_ln", "gated"]
ATTN_TYPES = ("relative", "shaw", "absolute", "al_rfou", "rotary")


@dataclass(kw_only=True)
class AgentConfig:
    """The memory core of an agent: a Transformer-XL over observation embeddings."""

    d_input: int
    """Width of the observation vectors fed in (a linear map embeds them to d_model)."""
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_inner: int = 256
    """Width of the position-wise feed-forward layer."""
    mem_len: int = 16
    """M: steps of its own episode each row keeps per layer; a query sees itself and these M. Reach: n_layer x M."""
    attn_type: AttnType = "relative"
    """The positional encoding (see the module docstring)."""
    layer: LayerKind = "plain"
    """'plain' post-LN Transformer-XL, 'pre_ln' the identity-map reordering, 'gated' GTrXL (pre-LN + GRU gates)."""
    gate_bias: float = 2.0
    """b_g of GTrXL's gate: the update gate starts at sigmoid(-b_g) (0.12 at 2), each layer near the identity."""
    learned_positions: int = 64
    """P: learned distances ('shaw') or episode indices ('al_rfou'); farther ones share the last."""
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("d_input", "d_model", "n_layer", "n_head", "d_inner", "mem_len", "learned_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AgentConfig.{name}={value!r} must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(f"AgentConfig.n_head={self.n_head} must divide d_model={self.d_model}")
        if self.attn_type not in ATTN_TYPES:
            raise ValueError(f"AgentConfig.attn_type={self.attn_type!r}: choose one of {', '.join(ATTN_TYPES)}")
        if self.layer not in ("plain", "pre_ln", "gated"):
            raise ValueError(f"AgentConfig.layer={self.layer!r}: choose 'plain', 'pre_ln' or 'gated'")
        if self.attn_type == "rotary" and (self.d_model // self.n_head) % 2:
            raise ValueError(f"attn_type='rotary' needs an even head width (d_model / n_head = {self.d_head})")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    @property
    def horizon(self) -> int:
        """Steps back the output of the last layer can reach: n_layer x mem_len."""
        return self.n_layer * self.mem_len


@dataclass
class AgentMemory:
    """Per-row memory of N rows: a fixed-size buffer, oldest step first, written in place by ``step``.

    states: (L, N, M, d) the inputs of each layer at the last M steps; valid: (N, M) which of those slots hold a step
    of the row's current episode; t: (N,) the index in its episode of the row's next step.
    """

    states: torch.Tensor
    valid: torch.Tensor
    t: torch.Tensor

    def reset(self, rows: torch.Tensor) -> None:
        """Empty the rows where ``rows`` (N,) bool is True (a new episode starts there); others untouched."""
        self.states[:, rows] = 0.0
        self.valid[rows] = False
        self.t[rows] = 0

    def clone(self) -> AgentMemory:
        """A detached copy (what a rollout's sequence starts from: stop-gradient, Dai et al. section 3.2)."""
        return AgentMemory(self.states.detach().clone(), self.valid.clone(), self.t.clone())

    def index(self, rows: torch.Tensor | slice) -> AgentMemory:
        """The memory of some rows (a batch of sequences for training)."""
        return AgentMemory(self.states[:, rows], self.valid[rows], self.t[rows])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"states": self.states, "valid": self.valid, "t": self.t}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> AgentMemory:
        return cls(state["states"].clone(), state["valid"].clone(), state["t"].clone())

    @staticmethod
    def stack(memories: list[AgentMemory]) -> AgentMemory:
        """Rows of several memories as one (B = the rows of all)."""
        return AgentMemory(torch.cat([m.states for m in memories], 1), torch.cat([m.valid for m in memories]),
                           torch.cat([m.t for m in memories]))


class CoreOutput(NamedTuple):
    hidden: torch.Tensor
    """(B, T, d) the last layer's output (after a final layer norm with pre-LN layers)."""
    layer_inputs: torch.Tensor
    """(L, B, T, d) what each layer read at each step: what memory keeps of it."""


class GRUGate(nn.Module):
    """GTrXL's gate g(x, y) in place of x + y (Parisotto et al. 2020, eq. 6-9 of section 3):

        r = sigmoid(W_r y + U_r x),  z = sigmoid(W_z y + U_z x - b_g),  h = tanh(W_g y + U_g (r * x)),
        g(x, y) = (1 - z) * x + z * h.

    With b_g > 0 the update gate z starts near 0 and g(x, y) near x: the layer begins as the identity.
    """

    def __init__(self, d: int, gate_bias: float) -> None:
        super().__init__()
        self.w = nn.Linear(d, 3 * d, bias=False)  # W_r, W_z, W_g of y
        self.u_rz = nn.Linear(d, 2 * d, bias=False)  # U_r, U_z of x
        self.u_g = nn.Linear(d, d, bias=False)  # U_g of r * x
        self.gate_bias = gate_bias

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        wr, wz, wg = self.w(y).chunk(3, dim=-1)  # (..., d) each
        ur, uz = self.u_rz(x).chunk(2, dim=-1)  # (..., d) each
        r = torch.sigmoid(wr + ur)
        z = torch.sigmoid(wz + uz - self.gate_bias)
        h = torch.tanh(wg + self.u_g(r * x))
        return (1 - z) * x + z * h

    def update_gate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """z (..., d): how much of the candidate replaces x (0: the identity)."""
        return torch.sigmoid(self.w(y).chunk(3, dim=-1)[1] + self.u_rz(x).chunk(2, dim=-1)[1] - self.gate_bias)


class AgentAttention(nn.Module):
    """Multi-head attention of a [memory; segment] window, with the positional terms of ``attn_type``.

    Parameters laid out as ``txl.model.attention.Attention``'s (qkv, out, r_proj, u, v; Shaw's r_emb, r_bias), so the
    tests can load one into the other.
    """

    def __init__(self, config: AgentConfig) -> None:
        super().__init__()
        H, D, d = config.n_head, config.d_head, config.d_model
        self.n_head, self.d_head, self.attn_type = H, D, config.attn_type
        self.scale = 1 / math.sqrt(D)
        self.qkv = nn.Linear(d, 3 * H * D, bias=False)
        self.out = nn.Linear(H * D, d, bias=False)
        if config.attn_type == "relative":
            self.r_proj = nn.Linear(d, H * D, bias=False)  # W_kR
            self.u = nn.Parameter(torch.zeros(H, D))  # global content bias, term (c)
            self.v = nn.Parameter(torch.zeros(H, D))  # global position bias, term (d)
        elif config.attn_type == "shaw":
            P = config.learned_positions
            self.u = nn.Parameter(torch.zeros(H, D))
            self.r_emb = nn.Parameter(torch.zeros(P, H, D))  # row P-1: distance 0
            self.r_bias = nn.Parameter(torch.zeros(P, H))

    def forward(self, q_in: torch.Tensor, kv_in: torch.Tensor, hide: torch.Tensor) -> torch.Tensor:
        """q_in: (B, T, d) the segment's rows; kv_in: (B, K, d) [memory; segment] rows (K = M + T, the segment's last);
        hide: (B, 1, T, K) bool, True where query i may not see key j. Returns (B, T, d)."""
        B, T, _ = q_in.shape
        K = kv_in.size(1)
        H, D = self.n_head, self.d_head
        w_q, w_kv = self.qkv.weight[:H * D], self.qkv.weight[H * D:]
        q = F.linear(q_in, w_q).view(B, T, H, D)  # (B, T, H, D)
        k, val = F.linear(kv_in, w_kv).view(B, K, 2, H, D).unbind(2)  # (B, K, H, D) each
        # Key j sits at window index j, query i at M + i: distance (M + i) - j, negative ones masked.
        dist = (torch.arange(K - T, K, device=q.device)[:, None] - torch.arange(K, device=q.device)[None, :])  # (T, K)
        dist = dist.clamp(min=0)
        if self.attn_type == "rotary":
            q, k = rotate_window(q, k)  # q_i . k_j depends on i - j alone
        if self.attn_type in ("relative", "shaw"):
            score = torch.einsum("bthd,bkhd->bhtk", q + self.u, k)  # (B, H, T, K): (a) + (c)
        else:
            score = torch.einsum("bthd,bkhd->bhtk", q, k)  # (B, H, T, K)
        if self.attn_type == "relative":
            # (b) + (d): (q + v) . W_kR R(i - j), R of every distance 0..K-1, then each pair's own (an explicit gather)
            r = self.r_proj(sinusoid(torch.arange(K, device=q.device), q.size(-1) * H).to(q.dtype))  # (K, H*D)
            pos = torch.einsum("bthd,khd->bhtk", q + self.v, r.view(K, H, D))  # (B, H, T, dist)
            score = score + pos.gather(-1, dist.expand(B, H, T, K))  # (B, H, T, K)
        elif self.attn_type == "shaw":
            P = self.r_emb.size(0)
            row = (P - 1 - dist).clamp(min=0)  # (T, K): distance 0 is row P-1, P or more share row 0
            emb, bias = self.r_emb[row], self.r_bias[row]  # (T, K, H, D), (T, K, H)
            score = score + torch.einsum("bthd,tkhd->bhtk", q, emb) + bias.permute(2, 0, 1)[None]  # (B, H, T, K)
        score = (score * self.scale).masked_fill(hide, float("-inf"))
        prob = torch.softmax(score, dim=-1)  # (B, H, T, K); every row sees itself: never empty
        attn = torch.einsum("bhtk,bkhd->bthd", prob, val).reshape(B, T, H * D)  # (B, T, H*D)
        return self.out(attn)  # (B, T, d)


class AgentLayer(nn.Module):
    """One layer: attention over [memory; segment] and a feed-forward net, joined as ``config.layer`` says."""

    def __init__(self, config: AgentConfig) -> None:
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self.kind = config.layer
        self.attn = AgentAttention(config)
        self.ff = nn.Sequential(nn.Linear(d, config.d_inner), nn.ReLU(), nn.Linear(config.d_inner, d))
        self.norm1, self.norm2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
        if self.kind == "gated":
            self.gate1, self.gate2 = GRUGate(d, config.gate_bias), GRUGate(d, config.gate_bias)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, hide: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d); memory: (B, M, d) this layer's cached inputs (no gradient); hide: (B, 1, T, K)."""
        window = torch.cat([memory.detach(), x], dim=1)  # (B, K, d)
        if self.kind == "plain":  # Dai et al.: post-LN residual blocks
            y = self.norm1(x + self.attn(x, window, hide))
            return self.norm2(y + self.ff(y))
        # Identity-map reordering (Parisotto et al. section 3.1): LN on the sub-layer's input, ReLU on its output.
        a = F.relu(self.attn(self.norm1(x), self.norm1(window), hide))  # (B, T, d)
        y = self.gate1(x, a) if self.kind == "gated" else x + a
        f = F.relu(self.ff(self.norm2(y)))
        return self.gate2(y, f) if self.kind == "gated" else y + f


def episode_masks(valid: torch.Tensor, starts: torch.Tensor, mem_len: int) -> torch.Tensor:
    """(B, 1, T, K) bool, True where query i may not see key j: the future, keys older than M steps before it, empty
    memory slots, and keys of an earlier episode than the query's (across an episode start in the sequence).

    valid: (B, M) memory slots holding the row's current episode; starts: (B, T) steps that begin an episode.
    """
    B, T = starts.shape
    M = valid.size(1)
    K = M + T
    # Episode number of each key: memory 0, segment step t the count of starts at or before it.
    seg_ep = starts.long().cumsum(1)  # (B, T)
    key_ep = torch.cat([torch.zeros(B, M, dtype=torch.long, device=starts.device), seg_ep], 1)  # (B, K)
    key_ok = torch.cat([valid, torch.ones(B, T, dtype=torch.bool, device=starts.device)], 1)  # (B, K)
    qi = torch.arange(M, K, device=starts.device)[:, None]  # (T, 1): query i at window index M + i
    kj = torch.arange(K, device=starts.device)[None, :]  # (1, K)
    window = (kj <= qi) & (kj >= qi - mem_len)  # (T, K): itself and the M steps before, no future
    same = seg_ep[:, :, None] == key_ep[:, None, :]  # (B, T, K)
    return ~(window[None] & same & key_ok[:, None, :])[:, None]  # (B, 1, T, K)


def episode_steps(t0: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(B, T) the index in its episode of each step: t0 (B,) + i until a start, then counted from that start."""
    B, T = starts.shape
    i = torch.arange(T, device=starts.device).expand(B, T)  # (B, T)
    last = torch.where(starts, i, torch.full_like(i, -1)).cummax(1).values  # (B, T) latest start at or before i
    return torch.where(last >= 0, i - last, t0[:, None] + i)


class TransformerXLCore(nn.Module):
    """Transformer-XL over observation vectors: ``step`` acts, ``forward`` trains on rollouts (module docstring)."""

    def __init__(self, config: AgentConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = nn.Linear(config.d_input, d)
        self.layers = nn.ModuleList(AgentLayer(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(d, eps=config.layer_norm_eps) if config.layer != "plain" else nn.Identity()
        if config.attn_type == "al_rfou":
            self.pos_embed = nn.Parameter(torch.zeros(config.n_layer, config.learned_positions, d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Orthogonal weights (gain sqrt(2)) and zero biases for every linear map, as PPO implementations do; the
        learned positional tables normal(0, 0.02) as the language model's; layer norms at 1 and 0. The gates keep
        nn.Linear's default (uniform, variance 1/(3 d)): their products stay small beside b_g, so z starts near
        sigmoid(-b_g) as GTrXL's identity start needs (an orthogonal sqrt(2) gain would spread z over (0, 1))."""
        gates = {id(m) for g in self.modules() if isinstance(g, GRUGate) for m in g.modules()}
        for module in self.modules():
            if isinstance(module, nn.Linear) and id(module) not in gates:
                nn.init.orthogonal_(module.weight, math.sqrt(2))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, AgentAttention):
                for name in ("r_emb", "r_bias", "u", "v"):
                    if hasattr(module, name):
                        nn.init.normal_(getattr(module, name), std=0.02)
        if hasattr(self, "pos_embed"):
            nn.init.normal_(self.pos_embed, std=0.02)

    def initial_memory(self, n: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
                       ) -> AgentMemory:
        """Empty memory for n rows."""
        c = self.config
        return AgentMemory(torch.zeros(c.n_layer, n, c.mem_len, c.d_model, device=device, dtype=dtype),
                           torch.zeros(n, c.mem_len, dtype=torch.bool, device=device),
                           torch.zeros(n, dtype=torch.long, device=device))

    def position_inputs(self, steps: torch.Tensor, layer: int) -> torch.Tensor | float:
        """What layer ``layer``'s input rows get added for their episode index ``steps`` (B, T): (B, T, d) or 0."""
        c = self.config
        if c.attn_type == "absolute" and layer == 0:
            B, T = steps.shape
            return sinusoid(steps.reshape(-1), c.d_model).view(B, T, c.d_model)  # (B, T, d)
        if c.attn_type == "al_rfou":
            return self.pos_embed[layer][steps.clamp(max=c.learned_positions - 1)]  # (B, T, d)
        return 0.0

    def forward(self, obs: torch.Tensor, memory: AgentMemory, starts: torch.Tensor) -> CoreOutput:
        """The sequence path: obs (B, T, d_input), memory the rows' memory before step 0 (read, not written; no
        gradient flows into it), starts (B, T) bool True where an episode begins at that step."""
        B, T, _ = obs.shape
        if memory.states.shape[1] != B or starts.shape != (B, T):
            raise ValueError(f"obs {tuple(obs.shape)}, memory of {memory.states.shape[1]} rows and starts "
                             f"{tuple(starts.shape)} must agree on B rows and T steps")
        # A sequence starting an episode at step 0 reads no memory (its slots belong to the episode before).
        valid = memory.valid & ~starts[:, :1]
        hide = episode_masks(valid, starts, self.config.mem_len)  # (B, 1, T, K)
        steps = episode_steps(memory.t, starts)  # (B, T)
        x = self.embed(obs)  # (B, T, d)
        inputs = []
        for layer_idx, layer in enumerate(self.layers):
            x = x + self.position_inputs(steps, layer_idx)
            inputs.append(x)
            x = layer(x, memory.states[layer_idx], hide)
        return CoreOutput(self.final_norm(x), torch.stack(inputs))

    @torch.no_grad()
    def write(self, memory: AgentMemory, layer_inputs: torch.Tensor, starts: torch.Tensor) -> None:
        """Append one step to every row's memory in place: layer_inputs (L, N, 1, d), starts (N,)."""
        memory.reset(starts)
        memory.states[:, :, :-1] = memory.states[:, :, 1:].clone()  # oldest step out (same buffer)
        memory.states[:, :, -1] = layer_inputs[:, :, 0]
        memory.valid[:, :-1] = memory.valid[:, 1:].clone()
        memory.valid[:, -1] = True
        memory.t += 1

    def step(self, obs: torch.Tensor, memory: AgentMemory, starts: torch.Tensor) -> torch.Tensor:
        """The acting path: obs (N, d_input) one step of N rows, starts (N,) bool rows whose episode begins now
        (their memory is emptied first). Returns (N, d) and writes the step into ``memory`` in place."""
        out = self.forward(obs[:, None], memory, starts[:, None])
        self.write(memory, out.layer_inputs, starts)
        return out.hidden[:, 0]  # (N, d)


def config_dict(config: AgentConfig) -> dict:
    """The config as plain data (saved with checkpoints)."""
    return dataclasses.asdict(config)
