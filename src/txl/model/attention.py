"""Multi-head attention over memory + segment, with the paper's relative positions and its ablations.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T key length,
H heads, D head width (d_head), d d_model, P learned positions.

Dai et al. 2019, section 3.3: with E the content and R(i-j) the sinusoidal encoding of the distance,

    A(i, j) = q_i . k_j            (a) content
            + q_i . W_kR R(i-j)    (b) content-dependent position
            + u . k_j              (c) global content bias
            + v . W_kR R(i-j)      (d) global position bias
            = (q_i + u) . k_j  +  (q_i + v) . W_kR R(i-j)

The first sum is one matmul against the keys; the second is one matmul against the K encodings,
realigned from "key index" to "distance" by ``rel_shift``. Queries are only computed for the T
segment rows: memory rows need keys and values alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig
from txl.model.dropout import Dropout


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
    """Realign (B, H, T, K) scores from "encoding index p" to "key index j" without a gather.

    Column p of row i holds the score against distance K-1-p. Query i sits at key index M+i, so key j
    is at distance M+i-j, i.e. p = T-1-i+j: the result is x[..., i, T-1-i+j]. Padding one zero
    column in front and reading the flat (T, K+1) buffer from offset T in rows of K (one less than the
    padded row) shifts row i left by T-1-i. Entries with j > M+i (future keys, always masked) are
    meaningless. A pad, a slice and views: their backward is a slice copy, not as_strided's scatter.
    """
    *lead, T, K = x.shape  # any leading dims, e.g. (B, H) or (H, B)
    padded = F.pad(x, (1, 0)).view(*lead, T * (K + 1))  # (..., T*(K+1))
    return padded[..., T:T + T * K].view(*lead, T, K)  # (..., T, K)


class Attention(nn.Module):
    """Causal multi-head attention over [memory; segment] with residual and layer norm.

    Subclasses add a positional term to the content scores. Parameters mirror the original layout:
    one fused q/k/v projection (W_q, W_kE, W_v), an output projection, one layer norm.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = config.n_head, config.d_head
        self.pre_ln = config.pre_ln
        self.scale = 1.0 / math.sqrt(config.d_head)
        hd = config.n_head * config.d_head
        self.qkv = nn.Linear(config.d_model, 3 * hd, bias=False)
        self.out = nn.Linear(hd, config.d_model, bias=False)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = Dropout(config.dropout)
        self.dropatt = Dropout(config.dropatt)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, mask: torch.Tensor,
                pos: torch.Tensor | None, u: torch.Tensor | None = None,
                v: torch.Tensor | None = None, kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: (B, T, d) segment; memory: (B, M, d) or None; mask: (T, K) True where a key is hidden.

        kv: the keys and values (B, K, H, D) of [memory; segment] already projected (``keys_values``,
        the memory rows' from a KVCache); memory is then None and only the query is projected here.
        """
        B, T, _ = x.shape
        H, D = self.n_head, self.d_head
        context = x if memory is None else torch.cat([memory.to(x.dtype), x], dim=1)  # (B, K, d)
        if self.pre_ln:  # the original pre-LN normalises memory rows too: memory caches raw layer inputs
            context = self.norm(context)
        w_q, w_kv = self.qkv.weight.split([H * D, 2 * H * D])
        q = F.linear(context[:, -T:], w_q).view(B, T, H, D)  # (B, T, H, D): segment rows only
        if kv is None:
            K = context.size(1)
            k, val = F.linear(context, w_kv).view(B, K, 2, H, D).unbind(2)  # (B, K, H, D) each
        else:
            k, val = kv  # (B, K, H, D) each
            K = k.size(1)

        query, bias = self.query_and_bias(q, K, pos, u, v)  # (B, T, H, D), (B, H, T, K) or None; both scaled
        # Heads are read as (B, H, ., D) views of the (B, ., H, D) projections, never copied for the fused kernel.
        query, k, val = query.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2)  # (B, H, ., D)
        dropatt = self.dropatt.p > 0 and self.training
        if not dropatt and (bias is None or not (torch.is_grad_enabled() and bias.requires_grad)):
            # One fused kernel (scaled_dot_product_attention): softmax(query k^T + bias) val, no (B, H, T, K)
            # probabilities kept. It cannot return the bias gradient, so training relative models take the
            # explicit path below.
            attn_mask = ~mask if bias is None else bias.masked_fill(mask, float("-inf"))  # (T, K) or (B, H, T, K)
            attn = F.scaled_dot_product_attention(query, k, val, attn_mask=attn_mask, scale=1.0)  # (B, H, T, D)
        else:
            score = torch.matmul(query, k.transpose(2, 3))  # (B, H, T, K)
            if bias is not None:
                score = score.add_(bias)
            score = score.masked_fill_(mask, float("-inf"))
            prob = self.dropatt(torch.softmax(score, dim=-1, dtype=torch.float32).to(val.dtype))  # (B, H, T, K)
            attn = torch.matmul(prob, val)  # (B, H, T, D)
        attn = attn.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        out = self.drop(self.out(attn))  # (B, T, d)
        return x + out if self.pre_ln else self.norm(x + out)

    def keys_values(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, d) layer inputs -> their keys W_kE h and values W_v h, (B, N, H, D) each.

        The same projection as ``forward`` makes of memory rows (of LN(h) with pre-LN: the norm is per
        row), so keys cached from here are the ones the uncached pass would recompute.
        """
        B, N, _ = rows.shape
        h = self.norm(rows) if self.pre_ln else rows
        w_kv = self.qkv.weight[self.n_head * self.d_head:]  # (2*H*D, d): W_kE and W_v
        k, val = F.linear(h, w_kv).view(B, N, 2, self.n_head, self.d_head).unbind(2)  # (B, N, H, D) each
        return k, val

    def query_and_bias(self, q: torch.Tensor, klen: int, pos: torch.Tensor | None, u: torch.Tensor | None,
                       v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scaled content query (B, T, H, D) and the scaled positional score (B, H, T, K) added to
        query . k, or None. Scaling the query instead of the scores saves a pass over (B, H, T, K).
        Plain attention: the query alone."""
        return q * self.scale, None

    def scores(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor | None, u: torch.Tensor | None,
               v: torch.Tensor | None) -> torch.Tensor:
        """Unscaled scores (B, H, T, K), content plus positional term, as forward computes them (for tests)."""
        query, bias = self.query_and_bias(q, k.size(1), pos, u, v)
        score = torch.matmul(query.transpose(1, 2), k.permute(0, 2, 3, 1))  # (B, H, T, K)
        return (score if bias is None else score + bias) / self.scale


class RelativeAttention(Attention):
    """The paper's relative attention, terms (a) + (b) + (c) + (d)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # W_kR: its own projection of the sinusoid, separate from W_kE inside qkv.
        self.r_proj = nn.Linear(config.d_model, config.n_head * config.d_head, bias=False)
        if config.untie_r:  # one pair of global biases per layer
            self.u = nn.Parameter(torch.zeros(config.n_head, config.d_head))
            self.v = nn.Parameter(torch.zeros(config.n_head, config.d_head))

    def position_keys(self, pos: torch.Tensor) -> torch.Tensor:
        """W_kR R: (N, d) encodings -> (N, H, D)."""
        return self.r_proj(pos).view(-1, self.n_head, self.d_head)  # (N, H, D)

    def query_and_bias(self, q, klen, pos, u, v):
        """pos: (K, d) encodings R, or (K, H, D) ones already projected by W_kR (a KVCache's table)."""
        B, T, H, D = q.shape
        u = self.u if u is None else u  # (H, D)
        v = self.v if v is None else v
        # (K, H, D): W_kR R, distances K-1 .. 0
        r = pos.to(q.dtype) if pos.dim() == 3 else self.position_keys(pos.to(q.dtype))
        query = (q + u) * self.scale  # (B, T, H, D): (a) + (c) against the keys
        # (b) + (d) as one matmul per head over all B*T queries: R is shared by the batch, so it is not copied
        # B times, as a (B, H, T, D) x (H, D, K) broadcast would.
        qv = ((q + v) * self.scale).permute(2, 0, 1, 3).reshape(H, B * T, D)  # (H, B*T, D)
        position = torch.bmm(qv, r.permute(1, 2, 0)).view(H, B, T, -1)  # (H, B, T, K)
        return query, rel_shift(position).permute(1, 0, 2, 3)  # (B, H, T, K) view


class ShawAttention(Attention):
    """Shaw et al. 2018 (the paper's Table 6 ablation): a learned embedding per relative distance.

    As the original's attn_type 1: scores (q + u) . k + q . E_dist + b_dist, with E (P, H, D) and
    b (P, H) indexed like R (row P-1 is distance 0); distances of P or more share row 0.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        P = config.learned_positions
        self.r_emb = nn.Parameter(torch.zeros(P, config.n_head, config.d_head))
        self.r_bias = nn.Parameter(torch.zeros(P, config.n_head))
        self.u = nn.Parameter(torch.zeros(config.n_head, config.d_head))

    def query_and_bias(self, q, klen, pos, u, v):
        K = klen
        emb, bias = self.r_emb, self.r_bias
        P = emb.size(0)
        if K > P:  # farther than learned: repeat the farthest
            emb = torch.cat([emb[:1].expand(K - P, -1, -1), emb])  # (K, H, D)
            bias = torch.cat([bias[:1].expand(K - P, -1), bias])  # (K, H)
        emb, bias = emb[-K:].to(q.dtype), bias[-K:].to(q.dtype)
        q = q * self.scale
        position = torch.matmul(q.transpose(1, 2), emb.permute(1, 2, 0))  # (B, H, T, K)
        position = position + (bias * self.scale).t()[None, :, None, :]  # (B, H, T, K)
        return q + self.u * self.scale, rel_shift(position)


def build_attention(config: ModelConfig) -> Attention:
    """The attention module for config.attn_type; absolute encodings are added to the layer inputs."""
    if config.attn_type == "relative":
        return RelativeAttention(config)
    if config.attn_type == "shaw":
        return ShawAttention(config)
    return Attention(config)  # 'absolute', 'al_rfou': positions live in the inputs
