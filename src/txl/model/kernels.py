"""The speed paths of the model, each tested against the plain computation it replaces.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T key length, H heads,
D head width, d d_model, N rows of a projected position table, A, C the two leading dims of a score block.

``Attention.reference`` (``txl.model.attention``) is the paper's equation term by term. What is here
computes the same numbers faster, chosen by ``ModelConfig.attn_impl`` ('fused') and
``ModelConfig.dropout_impl`` ('fast16'); tests/test_kernels.py compares each with the reference
(outputs, gradients of inputs and parameters, memories, every attention type, train and eval):

* ``fused_attention``: the fused kernel ``scaled_dot_product_attention`` with the positional scores
  (b) + (d) as its additive mask (evaluation), or with ``_RecomputedAttention``'s backward that recomputes
  the scores instead of keeping the (B, H, T, K) probabilities of every layer (training);
* ``realign``: ``rel_shift`` as a strided view with the mask added in the same pass, and an exact
  backward written straight into the scores' layout;
* ``FastDropout`` / ``FastReLUDropout``: a dropout mask of 16-bit draws kept as bytes;
* ``position_table`` / ``cached_keys_values``: the key/value cache's projections (``txl.model.kv_cache``).

Under ``torch.compile`` the custom autograd Functions are not traced (they carry Python callables and
in-place strided writes): the fused path then gives SDPA the positional scores built from ``rel_shift``
by ordinary ops, and the fast dropout becomes ``F.dropout``; the compiler fuses those itself.
Timings: benchmarks/README.md.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig

if TYPE_CHECKING:  # attention imports this module; the types are for annotations only
    from txl.model.attention import Attention, Positions
    from txl.model.kv_cache import KVCache


# -- rel_shift without the padded copy ------------------------------------------------------------

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
    mask in the pass that realigns anyway spares a masked_fill over (B, H, T, K), a slower bool-mask
    kernel on CPU (timings: benchmarks/README.md).
    """
    if torch.compiler.is_compiling():  # ordinary ops the compiler can trace and fuse
        from txl.model.attention import rel_shift
        shifted = rel_shift(scores)  # (A, C, T, K)
        return ((shifted.transpose(0, 1) if heads_first else shifted) + mask_bias).contiguous()  # (B, H, T, K)
    return _Realign.apply(scores.contiguous(), mask_bias, heads_first)


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, K) (or (B, 1, T, K)) bool, True where hidden -> the additive mask: 0 where visible, -inf where hidden."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


# -- the positional scores of each attention type, as the fused path builds them ------------------

def relative_bias(qv: torch.Tensor, r: torch.Tensor, *, mask_bias: torch.Tensor) -> torch.Tensor:
    """Terms (b) + (d) of the relative attention: (H, B*T, D) scaled (q + v), (K, H, D) W_kR R -> (B, H, T, K).

    One matmul per head over all B*T queries: R is shared by the batch, so it is not copied B times, as a
    (B, H, T, D) x (H, D, K) broadcast would. Realigned by distance i - j, the mask added.
    """
    H, BT, _ = qv.shape
    T, K = mask_bias.shape[-2:]  # (T, K), or (B, 1, T, K) with padding
    position = torch.bmm(qv, r.permute(1, 2, 0)).view(H, BT // T, T, K)  # (H, B, T, K)
    return realign(position, mask_bias, heads_first=True)  # (B, H, T, K)


def shaw_bias(q: torch.Tensor, emb: torch.Tensor, bias: torch.Tensor, *, scale: float,
              mask_bias: torch.Tensor) -> torch.Tensor:
    """Shaw et al.'s positional scores: (B, T, H, D) scaled q, (K, H, D) E, (K, H) b -> (B, H, T, K), realigned."""
    position = torch.matmul(q.transpose(1, 2), emb.permute(1, 2, 0))  # (B, H, T, K)
    position = position.add_((bias * scale).t()[None, :, None, :])  # (B, H, T, K)
    return realign(position, mask_bias, heads_first=False)  # (B, H, T, K)


def positional_inputs(attn: Attention, q: torch.Tensor, klen: int, positions: Positions | None,
                      v: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], functools.partial] | None:
    """The small tensors the (B, H, T, K) positional scores are made of, and the function that makes them
    (with a ``mask_bias`` keyword); None for plain attention. Their values carry the 1/sqrt(D) scale."""
    B, T, H, D = q.shape
    if attn.kind == "relative":
        r = attn.position_keys(klen, positions, q.dtype)  # (K, H, D)
        qv = ((q + attn.global_bias(v, "v")) * attn.scale).permute(2, 0, 1, 3).reshape(H, B * T, D)  # (H, B*T, D)
        return (qv, r), functools.partial(relative_bias)
    if attn.kind == "shaw":
        emb, bias = attn.distance_table(klen, q.dtype)  # (K, H, D), (K, H)
        return (q * attn.scale, emb, bias), functools.partial(shaw_bias, scale=attn.scale)
    return None


# -- attention: the fused kernel, and a backward that recomputes --------------------------------

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
    not kept from forward to backward, for the cost of the positional and content matmuls done again.
    dS is the bias gradient; autograd takes it on to the bias inputs.
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
        # on CPU, and the probabilities are the same up to rounding.
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


def explicit_attention(query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, bias: torch.Tensor,
                       dropatt: nn.Module) -> torch.Tensor:
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
        bias = bias.expand(B, H, T, K).contiguous()  # (B, H, T, K)
    if bias.dim() == 4:  # (B, H, T, K): the scores accumulate into it
        prob = _probabilities(bias.view(B * H, T, K), qh, kh)  # (B*H, T, K)
    else:  # (T, K), broadcast
        score = torch.baddbmm(bias, qh, kh.transpose(1, 2))  # (B*H, T, K)
        prob = torch.softmax(score, dim=-1, dtype=torch.float32).to(vh.dtype)  # (B*H, T, K)
    return torch.bmm(dropatt(prob), vh).view(B, H, T, D)  # (B, H, T, D)


def fused_attention(attn: Attention, q: torch.Tensor, k: torch.Tensor, val: torch.Tensor, *,
                    positions: Positions | None, u: torch.Tensor | None, v: torch.Tensor | None,
                    mask: torch.Tensor) -> torch.Tensor:
    """softmax(((q + u) k^T + positional scores) / sqrt(D), masked) val: (B, T, H, D) in, (B, H, T, D) out.

    The same numbers as ``attn.reference``. q: (B, T, H, D) unscaled; k, val: (B, K, H, D); mask: (T, K)
    bool, True where hidden. Which kernel runs depends on the autograd state and dropatt (below).
    """
    K = k.size(1)
    query = (q + attn.content_bias(u)) * attn.scale  # (B, T, H, D): scaling the query, not the (B, H, T, K) scores
    made = positional_inputs(attn, q, K, positions, v)
    mask_bias = mask_to_bias(mask, query.dtype)  # (T, K)
    # Heads are read as (B, H, ., D) views of the (B, ., H, D) projections; the kernels take the strides.
    qh, kh, vh = query.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2)  # (B, H, ., D)
    inputs, bias_fn = made if made is not None else ((), None)
    dropatt = attn.dropatt.p > 0 and attn.training
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qh, kh, vh, *inputs))
    if dropatt or (grad and bias_fn is not None and not attn.recompute):
        # The probabilities are dropped, or kept for backward by choice: they must exist.
        bias = mask_bias if bias_fn is None else bias_fn(*inputs, mask_bias=mask_bias)
        return explicit_attention(query, k, val, bias, attn.dropatt)
    if bias_fn is None:  # plain attention: the fused kernel, forward and backward
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=~mask, scale=1.0)  # (B, H, T, D)
    if grad and not torch.compiler.is_compiling():
        # The fused kernel cannot return the gradient of its additive mask (the positional term), so
        # training recomputes what it needs in backward instead of keeping it.
        return _RecomputedAttention.apply(qh, kh, vh, functools.partial(bias_fn, mask_bias=mask_bias), *inputs)
    # Evaluation, or training under torch.compile (whose SDPA decomposition differentiates the mask too):
    # the positional scores are the fused kernel's additive mask.
    bias = bias_fn(*inputs, mask_bias=mask_bias)  # (B, H, T, K)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=1.0)  # (B, H, T, D)


# -- dropout with a cheaper mask --------------------------------------------------------------------

def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """A bool mask (True = keep) with drop probability p quantised to 2**-16, and the scale 1 / P(keep).

    On CPU ``nn.Dropout`` draws one float per element with a serial Bernoulli sampler and keeps the scaled
    noise (4 bytes per element) for backward. Here one 64-bit ``random_`` call yields four 16-bit draws; an
    element is kept when its draw clears a threshold. The drop probability is therefore p rounded to a
    multiple of 2**-16, and the scale 1 / (1 - that probability), so every element keeps its expectation.
    """
    n = shape.numel()
    drop = round(p * 65536)
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)  # (ceil(n/4),)
    keep = bits.view(torch.int16)[:n].view(shape) >= drop - 32768  # (shape): uniform int16 draws
    return keep, 65536 / (65536 - drop)


def _apply(x: torch.Tensor, keep: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * keep * scale in one pass (into ``out``, which may be x itself); keep is bool, read as its 0/1 bytes.

    ``addcmul`` on the mask's bytes: one vectorised pass, where ``torch.where`` and a scaling take two."""
    return torch.addcmul(x.new_zeros(()), x, keep.view(torch.uint8), value=scale, out=out)


class _ScaleMask(torch.autograd.Function):
    """x * keep * scale, saving only the one-byte mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _apply(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return _apply(grad, keep, ctx.scale), None, None


class _ReLUScaleMask(torch.autograd.Function):
    """relu(x) * keep * scale, saving nothing of its own: the backward mask is (output > 0).

    An element passes the gradient exactly when it was kept and x > 0, i.e. when its output is positive
    (scale > 0). The output is the next linear layer's input, which autograd keeps anyway.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        r = torch.relu(x)
        out = _apply(r, keep, scale, out=r)
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        # threshold_backward(grad, out, 0) = grad where out > 0, else 0: ReLU's own vectorised backward.
        return torch.ops.aten.threshold_backward(grad, out, 0).mul_(ctx.scale), None, None


class FastDropout(nn.Dropout):
    """``nn.Dropout`` (same p field, same state dict) with the cheaper mask of ``keep_mask``.

    Not the same draws as ``nn.Dropout`` and p quantised to 2**-16; ``torch.manual_seed`` reproduces the
    masks. Identity in evaluation. Under torch.compile: ``F.dropout``, which the compiler fuses.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if torch.compiler.is_compiling():
            return F.dropout(x, self.p, training=True)
        keep, scale = keep_mask(x.shape, self.p, x.device)
        return _ScaleMask.apply(x, keep, scale)


class ReLUDropout(nn.Dropout):
    """dropout(relu(x)) with ``nn.Dropout``'s semantics. ``inplace=True``: for an input nothing else
    reads (a fresh linear output), the ReLU overwrites it instead of allocating another tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu_(x) if self.inplace else torch.relu(x)
        return F.dropout(r, self.p, self.training)


class FastReLUDropout(nn.Dropout):
    """dropout(relu(x)) in one step with ``FastDropout``'s mask: no ReLU input or mask kept for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or torch.compiler.is_compiling():
            r = torch.relu_(x) if self.inplace else torch.relu(x)
            return F.dropout(r, self.p, self.training)
        keep, scale = keep_mask(x.shape, self.p, x.device)
        return _ReLUScaleMask.apply(x, keep, scale)


def dropout(config: ModelConfig, p: float, *, relu: bool = False) -> nn.Module:
    """The dropout module ``config.dropout_impl`` asks for; ``relu``: dropout(relu(x)) in place."""
    if config.dropout_impl == "fast16":
        return FastReLUDropout(p, inplace=True) if relu else FastDropout(p)
    return ReLUDropout(p, inplace=True) if relu else nn.Dropout(p)


# -- the key/value cache's projections -------------------------------------------------------------

def position_table(attns: list[Attention], table: tuple[torch.Tensor, ...], need: int, *, clamp_len: int,
                   d_model: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per layer (N, H, D), row n = W_kR R(n), with N >= need (the largest distance + 1).

    W_kR R depends on the distance alone, so a cache projects each distance once. Grown by doubling, so a
    stream of (B, 1) steps projects each distance once; clamp_len caps it.
    """
    from txl.model.attention import sinusoid

    have = table[0].size(0) if table else 0
    if have >= need:
        return table
    cap = clamp_len + 1 if clamp_len > 0 else None
    size = max(need, 2 * have) if cap is None else min(max(need, 2 * have), cap)
    r = sinusoid(torch.arange(have, size, device=device), d_model).to(dtype)  # (size-have, d)
    new = [attn.project_positions(r) for attn in attns]  # (size-have, H, D) each
    return tuple(new) if not table else tuple(torch.cat([old, n]) for old, n in zip(table, new))


def cached_keys_values(attn: Attention, x: torch.Tensor, memory: torch.Tensor | None, cache: KVCache,
                       layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values (B, K, H, D) of [memory; segment], the memory rows' read from ``cache``.

    Only the T new rows are projected; an empty cache projects the memory rows once, here.
    """
    rows = x if cache.keys or memory is None else torch.cat([memory.to(x.dtype), x], dim=1)  # (B, T or K, d)
    k, val = attn.keys_values(rows)  # (B, T or K, H, D) each
    if cache.keys:
        k = torch.cat([cache.keys[layer].to(k.dtype), k], dim=1)  # (B, K, H, D)
        val = torch.cat([cache.values[layer].to(val.dtype), val], dim=1)  # (B, K, H, D)
    return k, val
