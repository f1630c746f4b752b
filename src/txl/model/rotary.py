"""Rotary position embedding (RoFormer, Su et al. 2021) over the [memory; segment] window: pure functions.

Shape legend: B batch, T query (segment) length, M memory length, K = M + T, H heads, D head width (even), N rows.

Each pair of channels (x[..., c], x[..., c + D/2]) of a query or key at position n is rotated by the angle
n * theta_c, theta_c = base^(-2c/D) (the half-split pairing of GPT-NeoX / Llama), so q_i . k_j depends on the
content and the distance i - j alone. Positions are the key indices 0..K-1 of [memory; segment] (query i at M + i),
applied at attention time: memory rows and cached keys hold unrotated W_k h and stay coherent as they move back a
segment, as with the paper's relative encoding (Dai et al. 2019, section 3.3).
"""

from __future__ import annotations

import torch

BASE = 10000.0
"""The frequency base of RoFormer and Vaswani et al.'s sinusoids."""


def angles(positions: torch.Tensor, d_head: int, base: float = BASE) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of n * theta_c: (N,) positions -> (N, D/2) each, float32."""
    inv_freq = base ** (-torch.arange(0, d_head, 2, device=positions.device, dtype=torch.float32) / d_head)  # (D/2,)
    theta = positions.float()[:, None] * inv_freq[None, :]  # (N, D/2)
    return theta.cos(), theta.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, N, H, D) rotated by the (N, D/2) angles: pairs (c, c + D/2), in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, N, H, D/2) each
    c, s = cos[None, :, None, :], sin[None, :, None, :]  # (1, N, 1, D/2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)  # (B, N, H, D)


def rotate_window(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, T, H, D) and keys (B, K, H, D) of one window rotated by their key index: key j by j,
    query i by K - T + i (its own key's index), so q_i . k_j depends on i - j alone."""
    T, K, D = q.size(1), k.size(1), q.size(-1)
    cos, sin = angles(torch.arange(K, device=k.device), D)  # (K, D/2) each
    return rotate(q, cos[K - T:], sin[K - T:]), rotate(k, cos, sin)
