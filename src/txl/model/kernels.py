"""Attention kernels on tensors: the default ('fused') path, each tested against ``txl.model.plain``.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T key length, H heads,
D head width, A, C the two leading dims of a score block.

A kernel takes tensors and plain numbers, never the module that calls it (it sits below ``txl.model.attention``).
Each custom autograd Function stays for a measured win (benchmarks/README.md, "What the fast path keeps"):

* ``fused_attention``: SDPA with the positional scores as its additive mask (evaluation); in training
  ``explicit_attention`` (autograd keeps the probabilities) or ``_RecomputedAttention`` (``recompute_attention``);
* ``realign``: ``rel_shift`` as a strided view, scale and mask added in the same pass, exact backward (``_Realign``);
* ``positional_bias``: an encoding's positional scores (``Attention.scores_of``), realigned, scaled, masked.

Under ``torch.compile`` the Functions are not traced: ordinary ops take their place, which the compiler fuses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from txl.model.positions import rel_shift


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``t``'s device run in: autocast's where it is on, else ``t``'s own."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def layer_norm(norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; a 16-bit stream normalised in its own dtype, the norm's weight and bias cast to it (CUDA's layer
    norm takes one dtype for all three; its autocast would cast up and down again). Statistics in float32."""
    if x.dtype in (torch.float16, torch.bfloat16):
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.bias.to(x.dtype), norm.eps)
    return norm(x)


# -- rel_shift without the padded copy ------------------------------------------------------------

def _shifted_view(x: torch.Tensor) -> torch.Tensor:
    """The ``rel_shift`` of contiguous (A, C, T, K) scores as a view: y[i, j] = x[i, T-1-i+j] sits at flat offset
    i*K + T-1-i+j = (T-1) + i*(K-1) + j of its (T, K) block, so rows of K are read with a stride of K-1 from offset
    T-1. Row i's last entry is row i+1's first (a hidden future key for i < T-1)."""
    A, C, T, K = x.shape
    return x.as_strided((A, C, T, K), (C * T * K, T * K, K - 1, 1), x.storage_offset() + T - 1)


class _Realign(torch.autograd.Function):
    """Forward: the key-aligned positional scores plus the additive mask, a new (B, H, T, K) tensor. Backward: the
    gradient written straight into the scores' layout by one strided copy. Within a (T, K) block each score feeds
    one output entry, except the T-1 shared by the end of row i and the start of row i+1 (their two gradients
    added) and the first T-1, which feed none: the exact gradient."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask_bias: torch.Tensor, heads_first: bool, scale: float) -> torch.Tensor:
        shifted = _shifted_view(scores)  # (A, C, T, K)
        if heads_first:
            shifted = shifted.transpose(0, 1)  # (H, B, T, K) -> (B, H, T, K) view
        ctx.heads_first, ctx.scale, ctx.scores_shape = heads_first, scale, scores.shape
        out = torch.empty(shifted.shape, dtype=scores.dtype, device=scores.device)  # (B, H, T, K)
        return torch.add(mask_bias, shifted, alpha=scale, out=out)  # scaled in the same pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        A, C, T, K = ctx.scores_shape
        g = grad.transpose(0, 1) if ctx.heads_first else grad  # (A, C, T, K)
        buf = grad.new_empty(A, C, T * K)  # (A, C, T*K): the layout of the scores
        base = buf.storage_offset() + T - 1
        # Zeroed: the first T-1 entries, scores of distances beyond every query's reach (no output uses them), and
        # with T > 1 in the same kernel the last T-1, of which the copy below overwrites all but the block's last.
        if T > 1:
            buf.as_strided((A, C, 2, T - 1), (C * T * K, T * K, T * K - T + 1, 1), buf.storage_offset()).zero_()
        # Each row's first K-1 entries tile the rest of the block exactly ...
        rows = buf.as_strided((A, C, T, K - 1), (C * T * K, T * K, K - 1, 1), base)  # (A, C, T, K-1)
        torch.mul(g[..., :K - 1], ctx.scale, out=rows)  # the forward's scale, applied as the gradient is written
        # ... the rows' last entries add onto the next row's first, and the last row's onto the zeroed last entry.
        last = buf.as_strided((A, C, T), (C * T * K, T * K, K - 1), base + K - 1)  # (A, C, T)
        if T > 1:
            last.add_(g[..., K - 1], alpha=ctx.scale)
        else:
            torch.mul(g[..., K - 1], ctx.scale, out=last)
        return buf.view(A, C, T, K), None, None, None


def realign(scores: torch.Tensor, mask_bias: torch.Tensor, *, heads_first: bool, scale: float = 1.0) -> torch.Tensor:
    """Positional scores by encoding index -> (B, H, T, K) by key index (``rel_shift``), times ``scale``, mask added.
    scores: contiguous (H, B, T, K) if heads_first else (B, H, T, K), column p against distance K-1-p; mask_bias:
    (T, K), 0 where query i may see key j, else -inf (benchmarks/README.md, "What the fast path keeps")."""
    if torch.compiler.is_compiling():  # ordinary ops the compiler can trace and fuse
        shifted = rel_shift(scores)  # (A, C, T, K)
        shifted = shifted.transpose(0, 1) if heads_first else shifted  # (B, H, T, K)
        return (shifted * scale + mask_bias).contiguous()  # (B, H, T, K)
    return _Realign.apply(scores.contiguous(), mask_bias, heads_first, scale)


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, K) (or (B, 1, T, K)) bool, True where hidden -> the additive mask: 0 where visible, -inf where hidden."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


# -- the positional scores as the fused kernel reads them ------------------------------------------

def positional_bias(scores_of: Callable[..., torch.Tensor], *operands: torch.Tensor, mask_bias: torch.Tensor,
                    scale: float, index: torch.Tensor | None = None) -> torch.Tensor:
    """An encoding's positional scores ``scores_of(*operands)`` (B, H, T, K) by distance realigned by key index,
    times ``scale``, the mask added: the fused kernel's additive bias. ``index``: (T, K), the table row each (query,
    key) reads, for keys in any order (``txl.static_eval``'s rings; evaluation only): gathered, not realigned."""
    scores = scores_of(*operands)  # (B, H, T, K), laid out (B, H, T, K) or (H, B, T, K); with index K = N
    if index is not None:
        # gather of the expanded index (take_along_dim's broadcast is slower on a CPU)
        position = scores.gather(-1, index.expand(*scores.shape[:3], index.size(-1)))  # (B, H, T, K)
        return torch.add(mask_bias, position, alpha=scale)  # (B, H, T, K)
    heads_first = not scores.is_contiguous() and scores.transpose(0, 1).is_contiguous()
    return realign(scores.transpose(0, 1) if heads_first else scores, mask_bias, heads_first=heads_first, scale=scale)


# -- attention: the fused kernel, pinned ----------------------------------------------------------

SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""The SDPA kernels txl's attention may run on: every one but cuDNN's, which builds an execution plan for every new
(shape, stride) of the dense bias, and K = M + T changes while the memory fills (benchmarks/README.md, "What the
fast path keeps"). Flash runs where there is no bias; math is the fallback."""


def sdpa(query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, attn_mask: torch.Tensor, scale: float = 1.0,
         pin: bool = True) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, k, val, attn_mask=, scale=)``, on ``SDPA_BACKENDS`` with ``pin``
    (``ComputePlan.pin_sdpa``: off on a CPU, which has no cuDNN and where the context costs time)."""
    with sdpa_kernel(list(SDPA_BACKENDS)) if pin else contextlib.nullcontext():
        return F.scaled_dot_product_attention(query, k, val, attn_mask=attn_mask, scale=scale)


def _forward_autocast(device: torch.device) -> dict:
    """The forward's autocast state, for a backward that must compute under it to the same dtypes."""
    kind = device.type
    return dict(device_type=kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind))


class _RecomputedAttention(torch.autograd.Function):
    """softmax(scale * query k^T + bias) val for training (``recompute_attention``), keeping neither the (B, H, T, K)
    bias nor the probabilities for backward: memory, not speed (benchmarks/README.md, "What the fast path keeps").
    Backward recomputes the bias (``bias_fn(*inputs)``) and P, then as FlashAttention's backward
    dS = P * (dP - rowsum(dO * O)), dP = dO val^T; autograd takes dS on to the bias inputs."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, scale: float, pin: bool, bias_fn,
                *bias_inputs: torch.Tensor):
        # query: (B, H, T, D), its products with the keys scaled by ``scale``; k, val: (B, H, K, D); any strides.
        with torch.no_grad():
            out = sdpa(query, k, val, bias_fn(*bias_inputs), scale, pin)  # (B, H, T, D)
        ctx.autocast = _forward_autocast(query.device)  # backward recomputes under it, to the same dtypes
        ctx.scale, ctx.bias_fn = scale, bias_fn
        ctx.save_for_backward(query, k, val, out, *bias_inputs)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        query, k, val, out, *bias_inputs = ctx.saved_tensors
        B, H, T, D = query.shape
        K, scale = k.size(2), ctx.scale
        with torch.autocast(**ctx.autocast), torch.enable_grad():
            inputs = [x.detach().requires_grad_(x.requires_grad) for x in bias_inputs]
            bias = ctx.bias_fn(*inputs)  # (B, H, T, K)
        qh, kh, vh = (t.reshape(B * H, -1, D) for t in (query, k, val))  # (B*H, T or K, D)
        dt = bias.dtype  # the scores accumulate into the recomputed bias (its graph does not need its values)
        score = bias.detach().view(B * H, T, K).baddbmm_(qh.to(dt), kh.to(dt).transpose(1, 2), alpha=scale)
        prob = torch.softmax(score, dim=-1, dtype=torch.float32).to(dt)  # (B*H, T, K), hidden keys 0
        go = grad_out.reshape(B * H, T, D).to(dt)  # (B*H, T, D)
        grad_val = torch.bmm(prob.transpose(1, 2), go)  # (B*H, K, D)
        delta = torch.bmm(go.reshape(B * H * T, 1, D), out.reshape(B * H * T, D, 1).to(dt))  # rowsum(dO * O)
        grad_score = torch.bmm(go, vh.to(dt).transpose(1, 2)).sub_(delta.view(B * H, T, 1)).mul_(prob)  # dS
        del prob, score
        grad_query = torch.bmm(grad_score, kh.to(dt)).mul_(scale).view(B, H, T, D)
        grad_key = torch.bmm(grad_score.transpose(1, 2), qh.to(dt)).mul_(scale).view(B, H, K, D)
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(bias, wanted, grad_score.view(B, H, T, K)) if wanted else ())
        grad_inputs = [next(grads) if x.requires_grad else None for x in inputs]
        return grad_query, grad_key, grad_val.view(B, H, K, D), None, None, None, *grad_inputs


def explicit_attention(query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, bias: torch.Tensor,
                       dropout: Callable[[torch.Tensor], torch.Tensor] | None = None, *, scale: float = 1.0
                       ) -> torch.Tensor:
    """softmax(scale * query k^T + bias) val with the probabilities kept for backward (and dropped out by
    ``dropout``): (B, H, T, D). query: (B, T, H, D); k, val: (B, K, H, D); bias: (B, H, T, K), (B, 1, T, K) or
    (T, K), -inf where hidden."""
    (B, T, H, D), K = query.shape, k.size(1)
    qh, kh, vh = (t.transpose(1, 2).reshape(B * H, -1, D) for t in (query, k, val))  # (B*H, T or K, D)
    if bias.dim() == 4:  # (B, H, T, K), or (B, 1, T, K) with padding: one per head
        bias = bias.expand(B, H, T, K).reshape(B * H, T, K)  # (B*H, T, K)
    score = torch.baddbmm(bias, qh, kh.transpose(1, 2), alpha=scale)  # (B*H, T, K)
    # A 16-bit score's own softmax accumulates in float32 and rounds once: the float32 softmax's numbers, no casts
    sixteen = score.dtype in (torch.float16, torch.bfloat16)
    prob = torch.softmax(score, -1) if sixteen else torch.softmax(score, -1, dtype=torch.float32).to(vh.dtype)
    prob = prob if dropout is None else dropout(prob)
    return torch.bmm(prob, vh).view(B, H, T, D)  # (B, H, T, D)


def fused_attention(query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, *, mask: torch.Tensor,
                    bias_fn: Callable[..., torch.Tensor] | None = None, bias_inputs: tuple[torch.Tensor, ...] = (),
                    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None, recompute: bool = True,
                    scale: float = 1.0, pin: bool = True) -> torch.Tensor:
    """softmax(scale * query k^T + positional scores, masked) val: (B, T, H, D) in, (B, H, T, D) out.
    query: (B, T, H, D), content bias added; scale: multiplies its products with the keys (1/sqrt(D)); k, val:
    (B, K, H, D); mask: (T, K) bool (or (B, 1, T, K) with padding), True where hidden. The positional scores, when
    the encoding has them, are ``bias_fn(*bias_inputs, mask_bias=)`` (scaled, realigned, mask added), so training
    can recompute them in backward. dropout: the attention dropout module (None: none); recompute: in training,
    recompute the scores in backward instead of keeping the probabilities; pin: SDPA on ``SDPA_BACKENDS``."""
    # Heads are read as (B, H, ., D) views of the (B, ., H, D) projections; the kernels take the strides.
    qh, kh, vh = query.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2)  # (B, H, ., D)
    if bias_fn is None and dropout is None:  # no positional scores: the fused kernel, forward and backward
        return sdpa(qh, kh, vh, ~mask, scale, pin)  # (B, H, T, D)
    mask_bias = mask_to_bias(mask, query.dtype)  # (T, K) or (B, 1, T, K)
    # The fused kernel cannot return the gradient of its additive mask (the positional term): training keeps the
    # probabilities (autograd), or recomputes what it needs in backward; dropped probabilities must exist.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qh, kh, vh, *bias_inputs))
    explicit = dropout is not None or (grad and not torch.compiler.is_compiling())
    if explicit and recompute and dropout is None:
        return _RecomputedAttention.apply(qh, kh, vh, scale, pin, functools.partial(bias_fn, mask_bias=mask_bias),
                                          *bias_inputs)
    bias = mask_bias if bias_fn is None else bias_fn(*bias_inputs, mask_bias=mask_bias)  # (B, H, T, K)
    if explicit:
        return explicit_attention(query, k, val, bias, dropout, scale=scale)
    # Evaluation, or training under torch.compile (whose SDPA decomposition differentiates the mask too).
    return sdpa(qh, kh, vh, bias, scale, pin)  # (B, H, T, D)
