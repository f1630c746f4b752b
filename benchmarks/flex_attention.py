"""FlexAttention for the relative attention: the positional term as a ``score_mod`` over a precomputed table.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T key length, H heads, D head width.

``kernels.fused_attention`` gives SDPA the positional scores (terms (b) + (d), Dai et al. 2019, section 3.3) as
a dense additive bias: the (H, B, T, K) products (q + v) . W_kR R(K-1-p) are realigned from distance to key
index (``rel_shift``, a strided copy) with the causal mask added, and SDPA reads that (B, H, T, K) tensor.
Here the products stay as they come out of the matmul, by distance, and FlexAttention's ``score_mod`` reads the
realigned entry itself, ``score + table[h, b, i, K-1-M-i+j]``; the causal mask is a block mask, so blocks of
keys no query sees are skipped, not filled with -inf. No realigned copy and no mask tensor are made.

A candidate beside SDPA, not a path of the model, so it lives beside its benchmark (``benchmarks.flex`` times the
two on a device). Its forward equals the fused kernel's (tests/test_flex.py, on a CPU, where torch runs
FlexAttention unfused); torch 2.13 has no FlexAttention backward on a CPU, so its gradients (to the query, keys,
values, and through the captured table to q + v and W_kR R) are checked on CUDA only (``-m gpu``). Causal masking
only: same_length, padding and attention dropout stay with ``txl.model.kernels``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from txl.model import kernels


def position_table(qv: torch.Tensor, r: torch.Tensor, batch: int) -> torch.Tensor:
    """(H, B*T, D) scaled (q + v) and (K, H, D) W_kR R -> (H, B, T, K) positional scores, column p against
    distance K-1-p (not realigned): ``RelativeAttention.scores_of``, one matmul per head."""
    H, BT, _ = qv.shape
    K = r.size(0)
    return torch.bmm(qv, r.permute(1, 2, 0)).view(H, batch, BT // batch, K)  # (H, B, T, K)


def relative_bias(qv: torch.Tensor, r: torch.Tensor, *, mask_bias: torch.Tensor) -> torch.Tensor:
    """The dense bias the model's fused path hands SDPA for these operands: ``position_table`` realigned by key
    index, the (T, K) mask added: (B, H, T, K). A ``bias_fn`` of ``kernels.fused_attention``."""
    return kernels.realign(position_table(qv, r, qv.size(1) // mask_bias.size(-2)), mask_bias, heads_first=True)


def relative_flex_attention(query: torch.Tensor, k: torch.Tensor, val: torch.Tensor, qv: torch.Tensor,
                            r: torch.Tensor, *, attend: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """softmax(query k^T + realigned (q + v) W_kR R, causal) val: (B, T, H, D) query in, (B, H, T, D) out.

    query: (B, T, H, D), content bias u added and scaled by 1/sqrt(D); k, val: (B, K, H, D) keys and values of
    [memory; segment]; qv: (H, B*T, D) scaled (q + v); r: (K, H, D) W_kR R for distances K-1 .. 0 (the
    operands of ``relative_bias``). ``attend``: the
    FlexAttention to call (``torch.compile(flex_attention)`` on a GPU, the fused kernel; None: torch's own,
    unfused in eager mode).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, T, H, _ = query.shape
    K = k.size(1)
    M = K - T
    table = position_table(qv, r, B)  # (H, B, T, K) by distance

    def score_mod(score, b, h, i, j):
        # Key j seen from query i (key index M + i) is at distance M + i - j: column K-1-(M+i-j) of the table.
        # Hidden keys (j > M + i) would read past the last column: they read the last one, and are masked.
        p = K - 1 - M - i + j
        return score + table[h, b, i, torch.where(p < K, p, K - 1)]

    def causal(b, h, i, j):
        return j <= M + i

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=T, KV_LEN=K, device=query.device)
    qh, kh, vh = query.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2)  # (B, H, ., D)
    return (attend or flex_attention)(qh, kh, vh, score_mod=score_mod, block_mask=block_mask, scale=1.0)


__all__ = ["position_table", "relative_flex_attention"]
