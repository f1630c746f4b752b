"""Positions: the sinusoid R, relative distances, ``rel_shift``, the per-layer ``Positions`` and the mask.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T key length, H heads,
D head width, d d_model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def sinusoid(distances: torch.Tensor, d_model: int) -> torch.Tensor:
    """R: (K,) distances -> (K, d_model) encodings, [sin | cos] halves as the original (no parameters), at the
    frequencies 1 / 10000^(2i/d) (Vaswani et al. 2017)."""
    inv_freq = (10000 ** (torch.arange(0, d_model, 2, device=distances.device, dtype=torch.float32) / d_model)
                ).reciprocal()  # (d/2,): 1.0 / x's numbers in one kernel
    angles = distances.float()[:, None] * inv_freq[None, :]  # (K, d/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (K, d)


def relative_distances(klen: int, clamp_len: int, device: torch.device | None = None) -> torch.Tensor:
    """The distances K-1, ..., 1, 0 of key index 0..K-1 from the last query; clamped beyond clamp_len."""
    dist = torch.arange(klen - 1, -1, -1, device=device)  # (K,)
    return dist.clamp(max=clamp_len) if clamp_len > 0 else dist


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Realign (..., T, K) scores from "encoding index p" to "key index j" (the original's pad-and-view form).

    Column p of row i holds the score against distance K-1-p. Query i sits at key index M+i, so key j is at
    distance M+i-j, i.e. p = T-1-i+j: the result is x[..., i, T-1-i+j]. Padding one zero column in front and reading
    the flat (T, K+1) buffer from offset T in rows of K (one less than the padded row) shifts row i left by T-1-i.
    Entries with j > M+i (future keys, always masked) are meaningless; ``kernels.realign`` needs no padded copy."""
    *lead, T, K = x.shape
    padded = F.pad(x, (1, 0)).reshape(*lead, T * (K + 1))  # (..., T*(K+1))
    return padded[..., T:].view(*lead, T, K)  # (..., T, K)


class Positions(NamedTuple):
    """What one layer's attention gets of the positions in a forward pass, for key index 0..K-1: each encoding sets
    what it uses, the rest stay None."""

    encodings: torch.Tensor | None = None
    """(K, d) the sinusoids R of distances K-1 .. 0 (clamped), dropout applied: relative attention
    projects them by its W_kR."""
    projected: torch.Tensor | None = None
    """(K, H, D) W_kR R of this layer already projected (read from a KVCache's table)."""
    absolute: torch.Tensor | None = None
    """(K, d) added to the layer's input rows (memory rows get the first M): the absolute encodings."""
    index: torch.Tensor | None = None
    """(T, K) int64: the row of ``projected`` query i reads for key j, where the keys are not in distance order (a
    ring, ``txl.static_eval``): the positional scores are gathered by it instead of realigned by ``rel_shift``."""


def attention_mask(qlen: int, mlen: int, *, mem_len: int, same_length: bool, style: str,
                   device: torch.device | None = None) -> torch.Tensor:
    """(T, K) bool, True where query i may not see key j. Causal: query i (key index M+i) sees keys j <= M+i. With
    same_length every query sees the same number of keys, the far ones hidden: mem_len keys in the original PyTorch /
    Hugging Face convention, mem_len + 1 in the original TensorFlow / NVIDIA one (the query's own position too)."""
    klen = mlen + qlen
    ones = torch.ones(qlen, klen, dtype=torch.bool, device=device)
    mask = torch.triu(ones, diagonal=1 + mlen)
    if same_length:
        mask_len = klen - mem_len - (1 if style == "tensorflow" else 0)
        shift = qlen - mask_len if mask_len > 0 else qlen
        mask = mask | torch.tril(ones, diagonal=-shift)
    return mask


def padding_mask(mask: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """(T, K) causal mask and (B, K) bool pads -> (B, 1, T, K): no real query sees a pad key; a pad query keeps its
    causal keys (pads, being on the left), so no softmax row is empty."""
    T = mask.size(0)
    hide = padding[:, None, :] & ~padding[:, -T:, None]  # (B, T, K)
    return (mask | hide)[:, None]  # (B, 1, T, K)
