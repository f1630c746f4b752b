"""Multi-head attention over memory + segment, with the paper's relative positions and its ablations.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T key length,
H heads, D head width (d_head), d d_model, P learned positions.

Dai et al. 2019, section 3.3: with E the content and R(i-j) the sinusoidal encoding of the distance,

    A(i, j) = q_i . k_j            (a) content
            + q_i . W_kR R(i-j)    (b) content-dependent position
            + u . k_j              (c) global content bias
            + v . W_kR R(i-j)      (d) global position bias
            = (q_i + u) . k_j  +  (q_i + v) . W_kR R(i-j)

``Attention.reference`` computes exactly this: the first sum is one product against the keys; the
second one against the K encodings, realigned from "encoding index" to "key index" by ``rel_shift``.
Shaw et al.'s ablation has its own positional term (a learned embedding and bias per distance); the
absolute ablations (Vaswani, Al-Rfou) have none here: their positions are added to the layer inputs.
Rotary positions (Su et al. 2021, ``txl.model.rotary``) have none either: they rotate q and k instead.
Queries are only computed for the T segment rows: memory rows need keys and values alone.

``ModelConfig.attn_impl`` chooses who computes it: 'reference' (this file), or 'fused' (the default,
``txl.model.kernels``: the same numbers from the fused attention kernel, tested against the reference).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig
from txl.model import kernels, rotary


def sinusoid(distances: torch.Tensor, d_model: int) -> torch.Tensor:
    """R: (K,) distances -> (K, d_model) encodings, [sin | cos] halves as the original (no parameters)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, device=distances.device, dtype=torch.float32)
                               / d_model))  # (d/2,)
    angles = distances.float()[:, None] * inv_freq[None, :]  # (K, d/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (K, d)


def relative_distances(klen: int, clamp_len: int, device: torch.device | None = None) -> torch.Tensor:
    """The distances K-1, ..., 1, 0 of key index 0..K-1 from the last query; clamped beyond clamp_len."""
    dist = torch.arange(klen - 1, -1, -1, device=device)  # (K,)
    return dist.clamp(max=clamp_len) if clamp_len > 0 else dist


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Realign (..., T, K) scores from "encoding index p" to "key index j" (the original's pad-and-view form).

    Column p of row i holds the score against distance K-1-p. Query i sits at key index M+i, so key j
    is at distance M+i-j, i.e. p = T-1-i+j: the result is x[..., i, T-1-i+j]. Padding one zero column
    in front and reading the flat (T, K+1) buffer from offset T in rows of K (one less than the padded
    row) shifts row i left by T-1-i. Entries with j > M+i (future keys, always masked) are meaningless.
    ``kernels.realign`` is the same shift without the padded copy.
    """
    *lead, T, K = x.shape
    padded = F.pad(x, (1, 0)).reshape(*lead, T * (K + 1))  # (..., T*(K+1))
    return padded[..., T:].view(*lead, T, K)  # (..., T, K)


class Positions(NamedTuple):
    """The relative encodings of one forward pass, for key index 0..K-1 (distances K-1 .. 0, clamped).

    Exactly one is set: the sinusoids R, which each layer projects by its W_kR, or W_kR R already projected
    for this layer (read from a KVCache's table).
    """

    encodings: torch.Tensor | None = None
    """(K, d) R, dropout applied."""
    projected: torch.Tensor | None = None
    """(K, H, D) W_kR R of this layer."""


class Attention(nn.Module):
    """Causal multi-head attention over [memory; segment] with residual and layer norm.

    Plain attention (the absolute ablations); subclasses add a positional term (``position_scores``)
    and a content bias (``content_bias``). Parameters mirror the original layout: one fused q/k/v
    projection (W_q, W_kE, W_v), an output projection, one layer norm.
    """

    kind = "plain"
    """Which positional term the kernels build: 'plain' (none), 'relative' or 'shaw'."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = config.n_head, config.d_head
        self.pre_ln = config.pre_ln
        self.impl = config.attn_impl
        self.recompute = config.recompute_attention
        self.scale = 1.0 / math.sqrt(config.d_head)
        hd = config.n_head * config.d_head
        self.qkv = nn.Linear(config.d_model, 3 * hd, bias=False)
        self.out = nn.Linear(hd, config.d_model, bias=False)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = kernels.dropout(config, config.dropout)
        self.dropatt = kernels.dropout(config, config.dropatt)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, mask: torch.Tensor,
                positions: Positions | None, u: torch.Tensor | None = None, v: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: (B, T, d) segment; memory: (B, M, d) or None; mask: (T, K) True where a key is hidden (or
        (B, 1, T, K) when rows hide different keys: padding);
        positions: the relative encodings (relative attention), else None; u, v: the model's shared
        biases (None: this layer's own, untie_r).

        kv: the keys and values (B, K, H, D) of [memory; segment] already projected
        (``kernels.cached_keys_values``); memory is then None and only the query is projected here.
        """
        B, T, _ = x.shape
        H, D = self.n_head, self.d_head
        h = self.norm(x) if self.pre_ln else x  # pre-LN normalises the rows the projections read
        if kv is None:
            # Segment rows: queries, keys and values in one matmul. Memory rows: keys and values alone, in a
            # matmul of their own, so that backward computes no input gradient for them (memory is constant).
            q, k, val = F.linear(h, self.qkv.weight).view(B, T, 3, H, D).unbind(2)  # (B, T, H, D) each
            if memory is not None:
                k_memory, val_memory = self.keys_values(memory.to(x.dtype))  # (B, M, H, D) each
                k, val = torch.cat([k_memory, k], dim=1), torch.cat([val_memory, val], dim=1)  # (B, K, H, D) each
        else:
            q = F.linear(h, self.qkv.weight[:H * D]).view(B, T, H, D)  # (B, T, H, D)
            k, val = kv  # (B, K, H, D) each
        q, k = self.place(q, k)
        attend = self.reference if self.impl == "reference" else kernels.fused_attention
        args = (q, k, val) if self.impl == "reference" else (self, q, k, val)
        attn = attend(*args, positions=positions, u=u, v=v, mask=mask)  # (B, H, T, D)
        attn = attn.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        out = self.drop(self.out(attn))  # (B, T, d)
        return x + out if self.pre_ln else self.norm(x + out)

    def reference(self, q: torch.Tensor, k: torch.Tensor, val: torch.Tensor, *, positions: Positions | None,
                  u: torch.Tensor | None, v: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """The attention of Dai et al. 2019, section 3.3, term by term, every score materialised: (B, H, T, D).

        q: (B, T, H, D) queries of the segment; k, val: (B, K, H, D) keys and values of [memory; segment];
        mask: (T, K) bool, True where query i may not see key j.
        """
        ac = torch.einsum("bthd,bkhd->bhtk", q + self.content_bias(u), k)  # (B, H, T, K): (a) + (c)
        bd = self.position_scores(q, k.size(1), positions, v)  # (B, H, T, K) by encoding index, or None
        score = ac if bd is None else ac + rel_shift(bd)  # (b) + (d) realigned from distance to key index
        score = (score * self.scale).masked_fill(mask, float("-inf"))  # (B, H, T, K): no future keys
        prob = torch.softmax(score, dim=-1, dtype=torch.float32).to(val.dtype)  # (B, H, T, K)
        return torch.einsum("bhtk,bkhd->bhtd", self.dropatt(prob), val)  # (B, H, T, D)

    def place(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries (B, T, H, D) and keys (B, K, H, D) as the scores read them: unchanged here; rotary
        attention rotates them by their place in the window."""
        return q, k

    def content_bias(self, u: torch.Tensor | None) -> torch.Tensor | float:
        """What the query is shifted by against the keys, term (c): u (H, D), or 0 for plain attention."""
        return 0.0

    def position_scores(self, q: torch.Tensor, klen: int, positions: Positions | None,
                        v: torch.Tensor | None) -> torch.Tensor | None:
        """The positional scores (B, H, T, K), column p against distance K-1-p (before ``rel_shift``), unscaled;
        None: no positional term (absolute encodings live in the inputs)."""
        return None

    def keys_values(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, d) layer inputs -> their keys W_kE h and values W_v h, (B, N, H, D) each.

        The projection ``forward`` makes of memory rows (of LN(h) with pre-LN: the norm is per row), so keys
        cached from here are the ones the uncached pass would compute.
        """
        B, N, _ = rows.shape
        h = self.norm(rows) if self.pre_ln else rows
        w_kv = self.qkv.weight[self.n_head * self.d_head:]  # (2*H*D, d): W_kE and W_v
        k, val = F.linear(h, w_kv).view(B, N, 2, self.n_head, self.d_head).unbind(2)  # (B, N, H, D) each
        return k, val


class RelativeAttention(Attention):
    """The paper's relative attention, terms (a) + (b) + (c) + (d)."""

    kind = "relative"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # W_kR: its own projection of the sinusoid, separate from W_kE inside qkv.
        self.r_proj = nn.Linear(config.d_model, config.n_head * config.d_head, bias=False)
        if config.untie_r:  # one pair of global biases per layer
            self.u = nn.Parameter(torch.zeros(config.n_head, config.d_head))
            self.v = nn.Parameter(torch.zeros(config.n_head, config.d_head))

    def global_bias(self, shared: torch.Tensor | None, name: str) -> torch.Tensor:
        """u or v (H, D): the model's shared one, or this layer's own (untie_r) when ``shared`` is None."""
        return getattr(self, name) if shared is None else shared

    def content_bias(self, u):
        return self.global_bias(u, "u")  # (H, D)

    def project_positions(self, r: torch.Tensor) -> torch.Tensor:
        """W_kR R: (N, d) encodings -> (N, H, D)."""
        return self.r_proj(r).view(-1, self.n_head, self.d_head)  # (N, H, D)

    def position_keys(self, klen: int, positions: Positions, dtype: torch.dtype) -> torch.Tensor:
        """W_kR R: (K, H, D) for distances K-1 .. 0, projected here or read from the cache's table."""
        if positions.projected is not None:
            return positions.projected.to(dtype)  # (K, H, D)
        return self.project_positions(positions.encodings.to(dtype))  # (K, H, D)

    def position_scores(self, q, klen, positions, v):
        r = self.position_keys(klen, positions, q.dtype)  # (K, H, D)
        return torch.einsum("bthd,khd->bhtk", q + self.global_bias(v, "v"), r)  # (B, H, T, K): (b) + (d)


class ShawAttention(Attention):
    """Shaw et al. 2018 (the paper's Table 6 ablation): a learned embedding per relative distance.

    As the original's attn_type 1: scores (q + u) . k + q . E_dist + b_dist, with E (P, H, D) and
    b (P, H) indexed like R (row P-1 is distance 0); distances of P or more share row 0.
    """

    kind = "shaw"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        P = config.learned_positions
        self.r_emb = nn.Parameter(torch.zeros(P, config.n_head, config.d_head))
        self.r_bias = nn.Parameter(torch.zeros(P, config.n_head))
        self.u = nn.Parameter(torch.zeros(config.n_head, config.d_head))

    def content_bias(self, u):
        return self.u  # (H, D): its own, never the model's shared one

    def distance_table(self, klen: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K rows of E (K, H, D) and b (K, H) for distances K-1 .. 0."""
        emb, bias = self.r_emb, self.r_bias
        P = emb.size(0)
        if klen > P:  # farther than learned: repeat the farthest
            emb = torch.cat([emb[:1].expand(klen - P, -1, -1), emb])  # (K, H, D)
            bias = torch.cat([bias[:1].expand(klen - P, -1), bias])  # (K, H)
        return emb[-klen:].to(dtype), bias[-klen:].to(dtype)  # (K, H, D), (K, H)

    def position_scores(self, q, klen, positions, v):
        emb, bias = self.distance_table(klen, q.dtype)  # (K, H, D), (K, H)
        return torch.einsum("bthd,khd->bhtk", q, emb) + bias.t()[None, :, None, :]  # (B, H, T, K)


class RotaryAttention(Attention):
    """Rotary positions (Su et al. 2021): queries and keys rotated by their index in [memory; segment]
    (``txl.model.rotary``), so the content score q_i . k_j depends on the distance i - j alone. No
    positional term of its own and no parameters beyond plain attention's; keys are rotated here, at
    attention time, so memory rows and cached keys are stored unrotated and stay valid as they move back."""

    def place(self, q, k):
        return rotary.rotate_window(q, k)  # (B, T, H, D), (B, K, H, D)


def build_attention(config: ModelConfig) -> Attention:
    """The attention module for config.attn_type; absolute encodings are added to the layer inputs."""
    if config.attn_type == "relative":
        return RelativeAttention(config)
    if config.attn_type == "shaw":
        return ShawAttention(config)
    if config.attn_type == "rotary":
        return RotaryAttention(config)
    return Attention(config)  # 'absolute', 'al_rfou': positions live in the inputs
