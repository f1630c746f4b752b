"""Multi-head attention over memory + segment: one class per encoding, its traits and positional terms.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T key length,
H heads, D head width (d_head), d d_model, P learned positions, L layers.

Dai et al. 2019, section 3.3 (``txl.model.plain`` writes it out term by term):
A(i, j) = (q_i + u) . k_j + (q_i + v) . W_kR R(i-j), terms (a) + (c) and (b) + (d).

Each encoding (``ModelConfig.attn_type``) is one class that says once what it is and builds its own positional
inputs; everything else asks it through ``encoding(attn_type)``:

=========================  ============  ===========  =================  ===========================
class (attn_type)          relative      cacheable    clamps_distances   positions
=========================  ============  ===========  =================  ===========================
RelativeAttention          yes           yes          yes                sinusoid R, projected W_kR
ShawAttention              yes           yes          no (its own P)     learned E, b per distance
AbsoluteAttention          no            no           yes                sinusoid added to inputs
AlRfouAttention            no            no           no                 learned, added per layer
RotaryAttention            yes           yes          no                 q, k rotated by window index
=========================  ============  ===========  =================  ===========================

Every one positions rows by their index in the window, so every one reads a compressed memory. A new encoding is one
subclass here (with ``attn_type`` set) and its name in ``txl.config.AttnType``. Both paths ('reference',
``txl.model.plain``, and 'fused', ``txl.model.kernels``) read the same encoding methods: ``positional_operands`` and
``scores_of`` (the positional scores, written once), ``content_bias``, ``place``.
"""

from __future__ import annotations

import functools
import math
import typing
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import AttnType, ModelConfig
from txl.model import kernels, rotary
from txl.model.dropout import Dropout
from txl.model.kv_cache import position_table
from txl.model.positions import Positions, relative_distances, sinusoid


class Attention(nn.Module):
    """Causal multi-head attention over [memory; segment] with residual and layer norm; no positional term of its own
    (each encoding subclass adds its own). Parameters as the original: one fused q/k/v projection (W_q, W_kE, W_v),
    an output projection, one layer norm."""

    attn_type: ClassVar[str] = ""
    """The ``ModelConfig.attn_type`` this class implements."""
    title: ClassVar[str] = ""
    """Its name in tables and plots (the paper's Table 6 names the ablations by their authors)."""
    relative: ClassVar[bool] = False
    """The scores depend on the distance i - j alone, never on a key's absolute index: a left-padded batch
    reads each row as it would alone, and a segment step can be exported with memory in and out."""
    cacheable: ClassVar[bool] = False
    """The memory rows' keys and values do not change from step to step, so a ``KVCache`` may keep them
    (absolute encodings add to each memory row a position that shifts every step)."""
    clamps_distances: ClassVar[bool] = False
    """``Context.clamp_len`` applies to its positions (Shaw's learned table clamps at its own size)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = config.n_head, config.d_head
        self.pre_ln = config.pre_ln
        self.recompute = False  # training's fused attention recomputes its scores (the model's plan sets it)
        self.pin_sdpa = False  # SDPA inside its backend context (the model's plan sets it: txl.model.plan)
        self.scale = 1.0 / math.sqrt(config.d_head)
        hd = config.n_head * config.d_head
        self.qkv = nn.Linear(config.d_model, 3 * hd, bias=False)
        self.out = nn.Linear(hd, config.d_model, bias=False)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = Dropout(config.dropout)
        self.dropatt = Dropout(config.dropatt)

    # -- what an encoding declares at the model level -------------------------------------------------
    @classmethod
    def shared_parameters(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """{name: shape} of the parameters the model holds for this encoding (shared by, or indexed by,
        the layers); initialised normal(0, init_std)."""
        return {}

    @classmethod
    def build_positions(cls, config: ModelConfig, shared: dict[str, torch.Tensor], klen: int, clamp_len: int, *,
                        dtype: torch.dtype, device: torch.device, drop: nn.Module,
                        table: tuple[torch.Tensor, ...] = ()) -> list[Positions | None]:
        """Per layer, the positions of one forward pass over K = M + T keys (None: it has none). ``shared``: the
        model's ``shared_parameters`` by name; ``drop``: the model's embedding dropout; ``table``: a KVCache's
        per-layer positional table (``grow_table``), when there is one."""
        return [None] * config.n_layer

    @classmethod
    def grow_table(cls, attns: list[Attention], table: tuple[torch.Tensor, ...], klen: int, clamp_len: int, *,
                   d_model: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The KVCache's per-layer positional table, grown for K keys; () when the encoding keeps none."""
        return ()

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, mask: torch.Tensor,
                positions: Positions | None, u: torch.Tensor | None = None, v: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The fast path's attention (``txl.model.plain.attention`` is the same equation plainly). x: (B, T, d)
        segment; memory: (B, M, d) or None; mask: (T, K) True where a key is hidden (or (B, 1, T, K) with padding);
        positions: this layer's (``build_positions``), or None; u, v: the model's shared biases (None: this layer's
        own, untie_r); kv: the keys and values (B, K, H, D) of [memory; segment] already projected
        (``kv_cache.cached_keys_values``), memory then None."""
        B, T, _ = x.shape
        H, D = self.n_head, self.d_head
        h = kernels.layer_norm(self.norm, x) if self.pre_ln else x  # pre-LN normalises what the projections read
        # The fused q/k/v weight cast once and sliced after (a slice misses autocast's cache of cast weights)
        w = self.qkv.weight.to(kernels.compute_dtype(x))  # (3*H*D, d)
        if kv is None:
            # Segment rows: queries, keys and values in one matmul. Memory rows: keys and values alone, in a
            # matmul of their own, so that backward computes no input gradient for them (memory is constant).
            q, k, val = F.linear(h, w).view(B, T, 3, H, D).unbind(2)  # (B, T, H, D) each
            if memory is not None:
                k_memory, val_memory = self.keys_values(memory, w[H * D:])  # (B, M, H, D) each
                k, val = torch.cat([k_memory, k], dim=1), torch.cat([val_memory, val], dim=1)  # (B, K, H, D) each
        else:
            q = F.linear(h, w[:H * D]).view(B, T, H, D)  # (B, T, H, D)
            k, val = kv  # (B, K, H, D) each
        q, k = self.place(q, k)
        # Unscaled: the kernels scale by 1/sqrt(D) in their matmuls. (a) + (c) read q + u, u in the queries' dtype
        # (a 16-bit query would be promoted to float32)
        shift = self.content_bias(u)
        query = q + (shift.to(q.dtype) if isinstance(shift, torch.Tensor) else shift)  # (B, T, H, D)
        # (b) + (d): the positional scores made of small operands by the kernels (in backward again, to recompute)
        operands = self.positional_operands(q, k.size(1), positions, v)
        index = None if positions is None else positions.index  # keys in ring order (txl.static_eval): gathered
        bias_fn = None if operands is None else functools.partial(kernels.positional_bias, self.scores_of,
                                                                  scale=self.scale, index=index)
        attn = kernels.fused_attention(query, k, val, mask=mask, bias_fn=bias_fn, bias_inputs=operands or (),
                                       dropout=self.dropatt if self.training and self.dropatt.p > 0 else None,
                                       recompute=self.recompute, scale=self.scale, pin=self.pin_sdpa)  # (B, H, T, D)
        attn = attn.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        out = self.drop(self.out(attn))  # (B, T, d)
        return x + out if self.pre_ln else kernels.layer_norm(self.norm, x + out)

    def place(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries (B, T, H, D) and keys (B, K, H, D) as the scores read them: unchanged here; rotary attention
        rotates them by their index in the window (keys are stored and cached unrotated)."""
        return q, k

    def content_bias(self, u: torch.Tensor | None) -> torch.Tensor | float:
        """What the query is shifted by against the keys, term (c): u (H, D), or 0 without one."""
        return 0.0

    def positional_operands(self, q: torch.Tensor, klen: int, positions: Positions | None,
                            v: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
        """The small tensors the positional scores are made of (``scores_of``), e.g. q + v and W_kR R; None: the
        encoding has no positional term in the scores."""
        return None

    @staticmethod
    def scores_of(*operands: torch.Tensor) -> torch.Tensor:
        """The positional scores (B, H, T, K) of ``positional_operands``, unscaled, column p against distance
        K-1-p (before ``rel_shift``): written once, read by both paths."""
        raise NotImplementedError

    def position_scores(self, q: torch.Tensor, klen: int, positions: Positions | None,
                        v: torch.Tensor | None) -> torch.Tensor | None:
        """The positional scores (B, H, T, K) by distance of queries q (B, T, H, D); None: none."""
        operands = self.positional_operands(q, klen, positions, v)
        return None if operands is None else self.scores_of(*operands)

    def keys_values(self, rows: torch.Tensor, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, d) layer inputs -> their keys W_kE h and values W_v h, (B, N, H, D) each, as ``forward`` projects
        memory rows (so cached keys are the uncached pass's); ``weight``: W_kE and W_v (2*H*D, d) already cast to
        the compute dtype (None: cast here)."""
        B, N, _ = rows.shape
        if weight is None:  # (2*H*D, d): W_kE and W_v, cast as the matmul runs
            weight = self.qkv.weight[self.n_head * self.d_head:].to(kernels.compute_dtype(rows))
        # pre-LN: LN(rows) (per row); else the rows in the weights' dtype, as autocast would cast them in the matmul
        h = self.norm(rows.to(self.norm.weight.dtype)) if self.pre_ln else rows.to(weight.dtype)  # (B, N, d)
        return F.linear(h, weight).view(B, N, 2, self.n_head, self.d_head).unbind(2)  # (B, N, H, D) each


class RelativeAttention(Attention):
    """The paper's relative attention, terms (a) + (b) + (c) + (d)."""

    attn_type = "relative"
    title = "Ours (relative)"
    relative = True
    cacheable = True
    clamps_distances = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.r_proj = nn.Linear(config.d_model, config.n_head * config.d_head, bias=False)  # W_kR (W_kE: in qkv)
        if config.untie_r:  # one pair of global biases per layer
            self.u = nn.Parameter(torch.zeros(config.n_head, config.d_head))
            self.v = nn.Parameter(torch.zeros(config.n_head, config.d_head))

    @classmethod
    def shared_parameters(cls, config):  # u, v shared by all layers (section 3.3), unless untie_r
        return {} if config.untie_r else {"u": (config.n_head, config.d_head), "v": (config.n_head, config.d_head)}

    @classmethod
    def build_positions(cls, config, shared, klen, clamp_len, *, dtype, device, drop, table=()):
        if table and (clamp_len <= 0 or klen - 1 <= clamp_len):
            # No distance clamped: the cache's table holds the farthest first, so distances K-1 .. 0 are its last K
            # rows, a view (no gather)
            return [Positions(projected=t[t.size(0) - klen:]) for t in table]  # (K, H, D) each
        dist = relative_distances(klen, clamp_len, device)  # (K,): K-1 .. 0, clamped
        if table:  # clamped distances repeat the farthest row: index the cache's table (row n: distance N-1-n)
            return [Positions(projected=t[t.size(0) - 1 - dist]) for t in table]  # (K, H, D) each
        r = drop(sinusoid(dist, config.d_model).to(dtype))  # (K, d), shared by the layers
        return [Positions(encodings=r)] * config.n_layer

    @classmethod
    def grow_table(cls, attns, table, klen, clamp_len, *, d_model, dtype, device):
        farthest = min(klen - 1, clamp_len) if clamp_len > 0 else klen - 1  # dist[0], without a sync
        return position_table([a.project_positions for a in attns], table, farthest + 1, clamp_len=clamp_len,
                              d_model=d_model, dtype=dtype, device=device)

    def global_bias(self, shared: torch.Tensor | None, name: str) -> torch.Tensor:
        """u or v (H, D): the model's shared one, or this layer's own (untie_r) when ``shared`` is None."""
        return getattr(self, name) if shared is None else shared

    def content_bias(self, u):
        return self.global_bias(u, "u")  # (H, D)

    def project_positions(self, r: torch.Tensor) -> torch.Tensor:
        """W_kR R: (N, d) encodings -> (N, H, D)."""
        return self.r_proj(r).view(-1, self.n_head, self.d_head)  # (N, H, D)

    def positional_operands(self, q, klen, positions, v):
        qv = q + self.global_bias(v, "v").to(q.dtype)  # (B, T, H, D): 16-bit under autocast, as q
        r = positions.projected  # W_kR R (K, H, D), distances K-1 .. 0: read from the cache's table, or projected
        return qv, r.to(q.dtype) if r is not None else self.project_positions(positions.encodings.to(q.dtype))

    @staticmethod
    def scores_of(qv, r):
        # (b) + (d): (q + v) . W_kR R, one matmul per head over all B*T queries (R shared by the batch, not copied);
        # a bmm, not einsum, which copies its output under CPU autocast
        B, T, H, D = qv.shape
        scores = torch.bmm(qv.permute(2, 0, 1, 3).reshape(H, B * T, D), r.permute(1, 2, 0))  # (H, B*T, K)
        return scores.view(H, B, T, -1).transpose(0, 1)  # (B, H, T, K), laid out (H, B, T, K)


class ShawAttention(Attention):
    """Shaw et al. 2018 (the paper's Table 6 ablation), as the original's attn_type 1: scores (q + u) . k +
    q . E_dist + b_dist, E (P, H, D) and b (P, H) learned per distance, indexed like R (row P-1: distance 0)."""

    attn_type = "shaw"
    title = "Shaw et al. (2018)"
    relative = True
    cacheable = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        P = config.learned_positions
        self.u = nn.Parameter(torch.zeros(config.n_head, config.d_head))  # first: the initialisation's order
        self.r_emb = nn.Parameter(torch.zeros(P, config.n_head, config.d_head))
        self.r_bias = nn.Parameter(torch.zeros(P, config.n_head))

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

    def positional_operands(self, q, klen, positions, v):
        return q, *self.distance_table(klen, q.dtype)  # (B, T, H, D), (K, H, D), (K, H)

    @staticmethod
    def scores_of(q, emb, bias):
        return torch.einsum("bthd,khd->bhtk", q, emb) + bias.t()[None, :, None, :]  # (B, H, T, K)


class AbsoluteAttention(Attention):
    """Vaswani et al. 2017 (the paper's Table 6 ablation): one sinusoid added to the first layer's input,
    positions K-1 .. 0 (memory rows get the earlier ones); the attention itself has no positional term."""

    attn_type = "absolute"
    title = "Vaswani et al. (2017)"
    clamps_distances = True

    @classmethod
    def build_positions(cls, config, shared, klen, clamp_len, *, dtype, device, drop, table=()):
        r = sinusoid(relative_distances(klen, clamp_len, device), config.d_model).to(dtype)
        return [Positions(absolute=drop(r))] + [None] * (config.n_layer - 1)


class AlRfouAttention(Attention):
    """Al-Rfou et al. 2018 (the paper's Table 6 ablation): a learned absolute position embedding added to
    every layer's input (row P-1 the newest position; older than P positions repeat row 0)."""

    attn_type = "al_rfou"
    title = "Al-Rfou et al. (2018)"

    @classmethod
    def shared_parameters(cls, config):
        return {"pos_embed": (config.n_layer, config.learned_positions, config.d_model)}

    @classmethod
    def build_positions(cls, config, shared, klen, clamp_len, *, dtype, device, drop, table=()):
        out = []
        for emb in shared["pos_embed"]:  # (P, d) per layer
            P = emb.size(0)
            if klen > P:  # older than learned: repeat the oldest
                emb = torch.cat([emb[:1].expand(klen - P, -1), emb])  # (K, d)
            out.append(Positions(absolute=drop(emb[-klen:])))  # (K, d)
        return out


class RotaryAttention(Attention):
    """Rotary positions (RoFormer, Su et al. 2021), beside the paper's: queries and keys rotated by their index in
    [memory; segment] at attention time (``txl.model.rotary``), so q_i . k_j depends on the content and i - j alone;
    memory rows and cached keys hold unrotated W_k h. No positional term in the scores, no parameters."""

    attn_type = "rotary"
    title = "Rotary (Su et al. 2021)"
    relative = True
    cacheable = True

    def place(self, q, k):
        return rotary.rotate_window(q, k)  # (B, T, H, D), (B, K, H, D)


def encoding(attn_type: str) -> type[Attention]:
    """The class of ``attn_type``: ask it for the encoding's traits (``relative``, ``cacheable``,
    ``clamps_distances``, ``title``) instead of listing attention types by hand."""
    found, todo = {}, [Attention]
    while todo:  # every subclass, however deep
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.attn_type:
            found.setdefault(cls.attn_type, cls)
    if attn_type not in found:
        raise ValueError(f"attn_type={attn_type!r} has no attention class; known: {', '.join(sorted(found))}")
    return found[attn_type]


def attn_types(**traits: bool) -> tuple[str, ...]:
    """The attention types (in ``AttnType``'s order) whose class has these traits, e.g.
    ``attn_types(cacheable=True)``; all of them without arguments."""
    return tuple(t for t in typing.get_args(AttnType) if all(getattr(encoding(t), k) == v for k, v in traits.items()))


def either(names: tuple[str, ...]) -> str:
    """'a', 'a' or 'b', 'a', 'b' or 'c': attention types in a message."""
    quoted = [repr(n) for n in names]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


def build_attention(config: ModelConfig) -> Attention:
    """The attention module of one layer for ``config.attn_type``."""
    return encoding(config.attn_type)(config)
