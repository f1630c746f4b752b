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
realigned from "key index" to "distance" by ``rel_shift`` (``realign``, which also adds the mask).
Queries are only computed for the T segment rows: memory rows need keys and values alone.

Which computation runs (all give the same numbers, tested against each other):

* evaluation: the fused kernel ``scaled_dot_product_attention``, the positional scores (b) + (d) as its
  additive mask, the content query (q + u) inside it;
* training: the same fused forward, and a backward that recomputes the scores instead of keeping the
  (B, H, T, K) probabilities of every layer (``_RecomputedAttention``; ``recompute_attention=False`` keeps
  them, ``dropatt > 0`` must keep them);
* plain attention (the absolute ablations): the fused kernel with a boolean mask, forward and backward.
"""

from __future__ import annotations

import functools
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
    """Realign (..., T, K) scores from "encoding index p" to "key index j" (the original's pad-and-view form).

    Column p of row i holds the score against distance K-1-p. Query i sits at key index M+i, so key j
    is at distance M+i-j, i.e. p = T-1-i+j: the result is x[..., i, T-1-i+j]. Padding one zero column
    in front and reading the flat (T, K+1) buffer from offset T in rows of K (one less than the padded
    row) shifts row i left by T-1-i. Entries with j > M+i (future keys, always masked) are meaningless.
    The model uses ``realign``, the same shift without the padded copy.
    """
    *lead, T, K = x.shape
    padded = F.pad(x, (1, 0)).reshape(*lead, T * (K + 1))  # (..., T*(K+1))
    return padded[..., T:].view(*lead, T, K)  # (..., T, K)


def _shifted_view(x: torch.Tensor) -> torch.Tensor:
    """The ``rel_shift`` of contiguous (A, C, T, K) scores as a view, no pad needed.

    y[i, j] = x[i, T-1-i+j] sits at flat offset i*K + T-1-i+j = (T-1) + i*(K-1) + j of its (T, K)
    block: rows of K read with a stride of K-1 from offset T-1. Row i's last entry is row i+1's first
    (both a hidden future key for i < T-1); the last row ends at the block's last element.
    """
    A, C, T, K = x.shape
    return x.as_strided((A, C, T, K), (C * T * K, T * K, K - 1, 1), x.storage_offset() + T - 1)


class _Realign(torch.autograd.Function):
    """Forward: the key-aligned positional scores plus the additive mask, as a new (B, H, T, K) tensor.

    Backward: the gradient is written straight into the layout of the scores with one strided copy,
    instead of autograd's zero-filled buffer + scatter of ``as_strided`` (or the slice and pad copies of
    ``rel_shift``). Within a (T, K) block each score feeds one output entry, except the T-1 shared by
    the end of row i and the start of row i+1, whose two gradients are added, and the first T-1, which
    feed none: this is the exact gradient.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask_bias: torch.Tensor, heads_first: bool) -> torch.Tensor:
        shifted = _shifted_view(scores)  # (A, C, T, K)
        if heads_first:
            shifted = shifted.transpose(0, 1)  # (H, B, T, K) -> (B, H, T, K) view
        ctx.heads_first = heads_first
        ctx.scores_shape = scores.shape
        out = torch.empty(shifted.shape, dtype=scores.dtype, device=scores.device)  # (B, H, T, K)
        return torch.add(shifted, mask_bias, out=out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        A, C, T, K = ctx.scores_shape
        g = grad.transpose(0, 1) if ctx.heads_first else grad  # (A, C, T, K)
        buf = grad.new_empty(A, C, T * K)  # (A, C, T*K): the layout of the scores
        buf[..., :T - 1].zero_()  # scores of distances beyond every query's reach: no output uses them
        base = buf.storage_offset() + T - 1
        # Each row's first K-1 entries tile the rest of the block exactly ...
        rows = buf.as_strided((A, C, T, K - 1), (C * T * K, T * K, K - 1, 1), base)  # (A, C, T, K-1)
        rows.copy_(g[..., :K - 1])
        # ... the last row's last entry closes it, and the other rows' last entries add onto the next row's first.
        last = buf.as_strided((A, C, T), (C * T * K, T * K, K - 1), base + K - 1)  # (A, C, T)
        last[..., -1].copy_(g[..., -1, K - 1])
        last[..., :-1].add_(g[..., :-1, K - 1])
        return buf.view(A, C, T, K), None, None


def realign(scores: torch.Tensor, mask_bias: torch.Tensor, *, heads_first: bool) -> torch.Tensor:
    """Positional scores by encoding index -> (B, H, T, K) by key index (``rel_shift``), mask added.

    scores: contiguous (H, B, T, K) if heads_first else (B, H, T, K); column p holds the score against
    distance K-1-p. mask_bias: (T, K), 0 where query i may see key j and -inf elsewhere. Adding the
    mask in the pass that realigns anyway spares a masked_fill over (B, H, T, K): bool-mask kernels are
    several times slower than an add on CPU.
    """
    return _Realign.apply(scores.contiguous(), mask_bias, heads_first)


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, K) (or (B, 1, T, K)) bool, True where hidden -> the additive mask: 0 where visible, -inf where hidden."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _probabilities(score: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor) -> torch.Tensor:
    """softmax(score + qh kh^T) over the keys: (N, T, K) in ``score``'s dtype, accumulating into ``score``.

    score: a fresh (N, T, K) bias (positions and mask, -inf where hidden), consumed: the content scores are
    the accumulator of one batched matmul (baddbmm), so scores, positions and mask meet in the matmul's own
    output pass. In place, so the operands are cast to its dtype here: autocast skips in-place ops. The
    softmax runs in float32 (a hidden key gets probability 0).
    """
    dt = score.dtype
    score = score.baddbmm_(qh.to(dt), kh.to(dt).transpose(1, 2))  # (N, T, K)
    return torch.softmax(score, dim=-1, dtype=torch.float32).to(dt)  # (N, T, K)


class _RecomputedAttention(torch.autograd.Function):
    """softmax(query k^T + bias) val for training, keeping neither the (B, H, T, K) bias nor the probabilities.

    Forward: the fused kernel (scaled_dot_product_attention). Backward: the bias is recomputed from its
    small inputs (``bias_fn(*bias_inputs)``, e.g. (q + v) and W_kR R), the scores and probabilities
    from it, and then, as in FlashAttention's backward,
    dS = P * (dP - rowsum(dO * O)) with dP = dO val^T: one (B, H, T, K) tensor of probabilities per layer is
    not kept from forward to backward (192 MB at the benchmark's base shape), for the cost of the positional
    and content matmuls done again. dS is the bias gradient; autograd takes it on to the bias inputs.
    """

    @staticmethod
    def forward(ctx, query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, bias_fn, *bias_inputs: torch.Tensor):
        # query: (B, H, T, D) scaled; k, val: (B, H, K, D); any strides.
        with torch.no_grad():
            bias = bias_fn(*bias_inputs)  # (B, H, T, K), -inf where hidden
        out = F.scaled_dot_product_attention(query, k, val, attn_mask=bias, scale=1.0)  # (B, H, T, D)
        device = query.device.type  # backward recomputes under the forward's autocast, to the same dtypes
        ctx.autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device),
                            enabled=torch.is_autocast_enabled(device))
        ctx.bias_fn = bias_fn
        ctx.save_for_backward(query, k, val, out, *bias_inputs)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with torch.autocast(**ctx.autocast):
            return _RecomputedAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor):
        query, k, val, out, *bias_inputs = ctx.saved_tensors
        B, H, T, D = query.shape
        K = k.size(2)
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_(x.requires_grad) for x in bias_inputs]
            bias = ctx.bias_fn(*inputs)  # (B, H, T, K)
        qh = query.reshape(B * H, T, D)  # (B*H, T, D)
        kh = k.reshape(B * H, K, D)  # (B*H, K, D)
        vh = val.reshape(B * H, K, D)  # (B*H, K, D)
        go = grad_out.reshape(B * H, T, D)  # (B*H, T, D)
        # The scores accumulate into the recomputed bias (its gradient graph does not need its values). The
        # softmax kernel rather than exp(score - lse): torch.exp takes a slow path on the -inf of hidden keys
        # (twice the time of the whole softmax on CPU), and the probabilities are the same up to rounding.
        prob = _probabilities(bias.detach().view(B * H, T, K), qh, kh)  # (B*H, T, K), hidden keys 0
        grad_val = torch.bmm(prob.transpose(1, 2), go)  # (B*H, K, D)
        delta = (grad_out * out).sum(-1).reshape(B * H, T, 1)  # (B*H, T, 1): rowsum(dO * O) = rowsum(P * dP)
        grad_score = torch.bmm(go, vh.transpose(1, 2)).sub_(delta).mul_(prob)  # (B*H, T, K): dS
        del prob
        grad_query = torch.bmm(grad_score, kh)  # (B*H, T, D)
        grad_key = torch.bmm(grad_score.transpose(1, 2), qh)  # (B*H, K, D)
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(bias, wanted, grad_score.view(B, H, T, K)) if wanted else ())
        grad_inputs = [next(grads) if x.requires_grad else None for x in inputs]
        return (grad_query.view(B, H, T, D), grad_key.view(B, H, K, D), grad_val.view(B, H, K, D), None,
                *grad_inputs)


class Attention(nn.Module):
    """Causal multi-head attention over [memory; segment] with residual and layer norm.

    Subclasses add a positional term to the content scores (``positional_inputs`` and ``positional_bias``).
    Parameters mirror the original layout: one fused q/k/v projection (W_q, W_kE, W_v), an output
    projection, one layer norm.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = config.n_head, config.d_head
        self.pre_ln = config.pre_ln
        self.recompute = config.recompute_attention
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
        """x: (B, T, d) segment; memory: (B, M, d) or None; mask: (T, K) True where a key is hidden, or
        (B, 1, T, K) when rows hide different keys (padding).

        kv: the keys and values (B, K, H, D) of [memory; segment] already projected (``keys_values``,
        the memory rows' from a KVCache); memory is then None and only the query is projected here.
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
        K = k.size(1)

        query = self.content_query(q, u)  # (B, T, H, D), scaled
        inputs = self.positional_inputs(q, K, pos, v)  # what the (B, H, T, K) positional scores are made of
        mask_bias = mask_to_bias(mask, query.dtype)  # (T, K)
        # Heads are read as (B, H, ., D) views of the (B, ., H, D) projections; the kernels take the strides.
        qh, kh, vh = query.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2)  # (B, H, ., D)
        dropatt = self.dropatt.p > 0 and self.training
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qh, kh, vh, *(inputs or ())))
        if dropatt or (grad and inputs is not None and not self.recompute):
            # The probabilities are dropped, or kept for backward by choice: they must exist.
            bias = mask_bias if inputs is None else self.positional_bias(*inputs, mask_bias=mask_bias)
            attn = self.explicit(query, k, val, bias)
        elif inputs is None:  # plain attention: the fused kernel, forward and backward
            attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=~mask, scale=1.0)  # (B, H, T, D)
        elif grad:
            # The fused kernel cannot return the gradient of its additive mask (the positional term), so
            # training recomputes what it needs in backward instead of keeping it.
            bias_fn = functools.partial(self.positional_bias, mask_bias=mask_bias)
            attn = _RecomputedAttention.apply(qh, kh, vh, bias_fn, *inputs)  # (B, H, T, D)
        else:  # evaluation: the positional scores are the fused kernel's additive mask
            bias = self.positional_bias(*inputs, mask_bias=mask_bias)  # (B, H, T, K)
            attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=1.0)  # (B, H, T, D)
        attn = attn.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        out = self.drop(self.out(attn))  # (B, T, d)
        return x + out if self.pre_ln else self.norm(x + out)

    def explicit(self, query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """softmax(query k^T + bias) val with the probabilities kept (and dropped out): (B, H, T, D).

        query: (B, T, H, D) scaled; k, val: (B, K, H, D); bias: (B, H, T, K) (a fresh tensor, consumed) or
        (T, K), -inf where hidden. A key that is hidden gets probability 0, hence zero gradient.
        """
        B, T, H, D = query.shape
        K = k.size(1)
        qh = query.transpose(1, 2).reshape(B * H, T, D)  # (B*H, T, D)
        kh = k.transpose(1, 2).reshape(B * H, K, D)  # (B*H, K, D)
        vh = val.transpose(1, 2).reshape(B * H, K, D)  # (B*H, K, D)
        if bias.dim() == 4 and bias.size(1) != H:  # (B, 1, T, K) padding mask: one fresh bias per head
            bias = bias.expand(B, H, T, K).contiguous()
        if bias.dim() == 4:  # (B, H, T, K): the scores accumulate into it
            prob = _probabilities(bias.view(B * H, T, K), qh, kh)  # (B*H, T, K)
        else:  # (T, K), broadcast
            score = torch.baddbmm(bias, qh, kh.transpose(1, 2))  # (B*H, T, K)
            prob = torch.softmax(score, dim=-1, dtype=torch.float32).to(vh.dtype)  # (B*H, T, K)
        return torch.bmm(self.dropatt(prob), vh).view(B, H, T, D)  # (B, H, T, D)

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

    def content_query(self, q: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """The query (B, T, H, D) that meets the keys, scaled by 1/sqrt(D): scaling the query instead of
        the scores saves a pass over (B, H, T, K)."""
        return q * self.scale

    def positional_inputs(self, q: torch.Tensor, klen: int, pos: torch.Tensor | None,
                          v: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
        """The small tensors ``positional_bias`` makes the positional scores from; None: no positional term."""
        return None

    def positional_bias(self, *inputs: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        """The scaled positional scores (B, H, T, K) added to query . k, -inf where mask_bias hides a key."""
        raise NotImplementedError(f"{type(self).__name__} has no positional term")

    def query_and_bias(self, q: torch.Tensor, klen: int, pos: torch.Tensor | None, u: torch.Tensor | None,
                       v: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both halves of the scores at once: the scaled content query (B, T, H, D) and the masked
        positional scores (B, H, T, K), or None for plain attention."""
        inputs = self.positional_inputs(q, klen, pos, v)
        query = self.content_query(q, u)
        if inputs is None:
            return query, None
        return query, self.positional_bias(*inputs, mask_bias=mask_to_bias(mask, query.dtype))


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

    def content_query(self, q, u):
        """(q + u) / sqrt(D): terms (a) + (c) against the keys. u: the model's shared bias, or None (untie_r)."""
        return (q + (self.u if u is None else u)) * self.scale  # (B, T, H, D)

    def positional_inputs(self, q, klen, pos, v):
        """(q + v) / sqrt(D) as (H, B*T, D), and W_kR R as (K, H, D) for distances K-1 .. 0.

        pos: (K, d) encodings R, or (K, H, D) ones already projected by W_kR (a KVCache's table).
        """
        B, T, H, D = q.shape
        v = self.v if v is None else v  # (H, D)
        r = pos.to(q.dtype) if pos.dim() == 3 else self.position_keys(pos.to(q.dtype))  # (K, H, D)
        qv = ((q + v) * self.scale).permute(2, 0, 1, 3).reshape(H, B * T, D)  # (H, B*T, D)
        return qv, r

    def positional_bias(self, qv, r, *, mask_bias):
        """Terms (b) + (d) as one matmul per head over all B*T queries: R is shared by the batch, so it is not
        copied B times, as a (B, H, T, D) x (H, D, K) broadcast would. Realigned by distance i - j."""
        H, BT, _ = qv.shape
        T, K = mask_bias.shape[-2:]  # (T, K), or (B, 1, T, K) with padding
        position = torch.bmm(qv, r.permute(1, 2, 0)).view(H, BT // T, T, K)  # (H, B, T, K)
        return realign(position, mask_bias, heads_first=True)  # (B, H, T, K)


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

    def content_query(self, q, u):
        return (q + self.u) * self.scale  # (B, T, H, D)

    def positional_inputs(self, q, klen, pos, v):
        """q / sqrt(D), and the K rows of E and b for distances K-1 .. 0."""
        K = klen
        emb, bias = self.r_emb, self.r_bias
        P = emb.size(0)
        if K > P:  # farther than learned: repeat the farthest
            emb = torch.cat([emb[:1].expand(K - P, -1, -1), emb])  # (K, H, D)
            bias = torch.cat([bias[:1].expand(K - P, -1), bias])  # (K, H)
        return q * self.scale, emb[-K:].to(q.dtype), bias[-K:].to(q.dtype)  # (B, T, H, D), (K, H, D), (K, H)

    def positional_bias(self, q, emb, bias, *, mask_bias):
        position = torch.matmul(q.transpose(1, 2), emb.permute(1, 2, 0))  # (B, H, T, K)
        position = position.add_((bias * self.scale).t()[None, :, None, :])  # (B, H, T, K)
        return realign(position, mask_bias, heads_first=False)  # (B, H, T, K)


def build_attention(config: ModelConfig) -> Attention:
    """The attention module for config.attn_type; absolute encodings are added to the layer inputs."""
    if config.attn_type == "relative":
        return RelativeAttention(config)
    if config.attn_type == "shaw":
        return ShawAttention(config)
    return Attention(config)  # 'absolute', 'al_rfou': positions live in the inputs
