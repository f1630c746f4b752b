"""Rotary positions (txl.model.rotary): the rotation itself, and what makes it usable with recurrence:
scores that depend on the distance alone, so memory rows and cached keys keep their meaning as they move."""

import math

import pytest
import torch
from conftest import tiny_config

import txl
from txl.model import rotary


def test_rotation_equals_complex_multiplication():
    """Channel pairs (c, c + D/2) are complex numbers multiplied by exp(i n theta_c), theta_c = 10000^(-2c/D)."""
    x = torch.randn(2, 5, 3, 8)  # (B, N, H, D)
    positions = torch.tensor([0, 1, 4, 9, 30])
    cos, sin = rotary.angles(positions, 8)
    got = rotary.rotate(x, cos, sin)
    theta = torch.tensor([10000 ** (-2 * c / 8) for c in range(4)], dtype=torch.float64)  # (D/2,)
    z = torch.complex(x[..., :4].double(), x[..., 4:].double()) * torch.polar(
        torch.ones(5, 4, dtype=torch.float64), positions[:, None].double() * theta)[None, :, None, :]
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)  # a rotation
    torch.testing.assert_close(rotary.rotate(x, *rotary.angles(torch.zeros(5), 8)), x)  # position 0: identity


def test_window_scores_depend_on_the_distance_alone():
    """q_i . k_j after rotate_window equals the score of the same vectors placed anywhere else at the same
    distance: a window of K keys and one of K + 7 (a longer memory) give the same scores for shared pairs."""
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 10, 2, 8)  # (B, T, H, D), (B, K, H, D)
    qr, kr = rotary.rotate_window(q, k)
    padded = torch.cat([torch.randn(1, 7, 2, 8), k], dim=1)  # seven older keys in front
    qp, kp = rotary.rotate_window(q, padded)
    scores = torch.einsum("bthd,bkhd->bhtk", qr, kr)
    torch.testing.assert_close(torch.einsum("bthd,bkhd->bhtk", qp, kp)[..., 7:], scores, atol=1e-4, rtol=1e-4)
    # Query i (key index K - T + i) against key j: R(a) q . R(b) k = q . R(b - a) k, the key turned back by
    # the distance alone.
    i, j = 2, 3
    dist = 10 - 4 + i - j
    cos, sin = rotary.angles(torch.tensor([-dist]), 8)
    want = (q[:, i] * rotary.rotate(k[:, j:j + 1], cos, sin)[:, 0]).sum(-1)  # (B, H)
    torch.testing.assert_close(scores[:, :, i, j], want, atol=1e-4, rtol=1e-4)


def test_rotary_model_has_no_positional_parameters_and_rejects_odd_heads():
    model = txl.TransformerXL(tiny_config(attn_type="rotary"))
    plain = txl.TransformerXL(tiny_config(attn_type="absolute"))
    assert sorted(n for n, _ in model.named_parameters()) == sorted(n for n, _ in plain.named_parameters())
    with pytest.raises(ValueError, match="d_head=3 must be even"):
        tiny_config(d_model=18, n_head=6, d_head=None, attn_type="rotary")  # d_head derived: 18 // 6


def test_longer_evaluation_memory_only_adds_farther_keys():
    """With every query's window covering all history, the mem_len at evaluation does not matter: a rotary
    model scores a stream the same with memory 12 and memory 40 (positions are relative to the query)."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(mem_len=12, attn_type="rotary")).eval()
    tokens = torch.randint(0, 30, (2, 13))
    losses = []
    with torch.no_grad():
        for mem_len in (12, 40):
            memory, parts = None, []
            for s in range(0, 12, 4):
                out = model(tokens[:, s:s + 4], labels=tokens[:, s + 1:s + 5], memory=memory,
                            context=model.config.context(mem_len=mem_len))
                memory = out.memory
                parts.append(out.nll)
            losses.append(torch.cat(parts, 1))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert math.isfinite(float(losses[0].mean()))
