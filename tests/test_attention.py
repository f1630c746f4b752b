"""The attention fast paths: the fused kernel against the reference and the explicit path, and their gradients.

The full comparison of every kernel with the reference (every attention type, train and eval, memory,
same_length, clamp_len) is tests/test_kernels.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ATTN_TYPES, tiny_config

import txl
from txl.model.attention import Attention, attn_types, encoding
from txl.model.kernels import _RecomputedAttention
from txl.model.positions import attention_mask

TOL = dict(atol=1e-5, rtol=1e-5)


def tiny(attn_type: str, compute: txl.ComputeConfig | None = None, **changes) -> txl.TransformerXL:
    config = tiny_config(vocab_size=50, attn_type=attn_type, learned_positions=16, **changes)
    model = txl.TransformerXL(config, compute)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_fused_and_explicit_paths_agree(attn_type):
    """The fused kernel (positional term as the kernel's additive mask, without gradients; recomputing backward,
    with them) and the reference attention (every score materialised, the paper's equation) give the same
    log-probabilities and memories, segment after segment."""
    fused = tiny(attn_type)
    reference = txl.TransformerXL(fused.config, txl.ComputeConfig(attn_impl="reference")).eval()
    reference.load_state_dict(fused.state_dict())
    tokens = torch.randint(0, 50, (3, 16))
    mem_fused = mem_reference = mem_grad = None
    for s in range(3):
        x, y = tokens[:, 5 * s:5 * s + 5], tokens[:, 5 * s + 1:5 * s + 6]
        with torch.no_grad():
            got = fused(x, labels=y, memory=mem_fused, return_log_probs=True)
            want = reference(x, labels=y, memory=mem_reference, return_log_probs=True)
        with_grad = fused(x, labels=y, memory=mem_grad, return_log_probs=True)  # the training kernels
        torch.testing.assert_close(got.log_probs, want.log_probs, **TOL)
        torch.testing.assert_close(with_grad.log_probs, want.log_probs, **TOL)
        for a, b in zip(got.memory, want.memory, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        mem_fused, mem_reference, mem_grad = got.memory, want.memory, with_grad.memory


def explicit_attention(module: Attention, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain post-LN attention written out: softmax(q k^T / sqrt(D), masked) v, projected, residual, norm."""
    B, T, _ = x.shape
    H, D = module.n_head, module.d_head
    context = torch.cat([memory, x], dim=1)  # (B, K, d)
    q, k, v = F.linear(context, module.qkv.weight).view(B, -1, 3, H, D).unbind(2)  # (B, K, H, D) each
    q = q[:, -T:]
    score = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)  # (B, H, T, K)
    prob = torch.softmax(score.masked_fill(mask, float("-inf")), dim=-1)
    attn = torch.einsum("bhij,bjhd->bihd", prob, v).reshape(B, T, H * D)  # (B, T, H*D)
    return module.norm(x + module.out(attn))


def test_fused_kernel_gradients_equal_explicit_attention():
    """Plain attention trains through the fused kernel: its gradients equal the written-out computation."""
    module = tiny("absolute").layers[0].attn.train()
    x = torch.randn(2, 5, 32, requires_grad=True)
    memory = torch.randn(2, 3, 32)
    mask = attention_mask(5, 3, mem_len=3, same_length=False, style="pytorch")
    weight = torch.randn(2, 5, 32)
    (module(x, memory, mask, None) * weight).sum().backward()
    fused = [x.grad] + [p.grad for p in module.parameters()]
    x.grad = None
    module.zero_grad()
    (explicit_attention(module, x, memory, mask) * weight).sum().backward()
    for got, want in zip(fused, [x.grad] + [p.grad for p in module.parameters()], strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("attn_type", [t for t in attn_types()  # those with positional scores (not rotary's rotation)
                                       if encoding(t).positional_operands is not Attention.positional_operands])
def test_recomputed_training_attention_has_the_explicit_gradients(attn_type, monkeypatch):
    """Training with a positional term and recompute_attention keeps no probabilities: they are recomputed in
    backward. Every gradient equals the ones of the two paths that keep them (autograd's): recompute_attention=False
    (the default) and the explicit path (taken by a dropatt that drops nothing)."""
    torch.manual_seed(0)
    model = tiny(attn_type, txl.ComputeConfig(recompute_attention=True), untie_r=True).train()
    tokens = torch.randint(0, 50, (3, 12))
    memory = model(tokens[:, :5]).memory  # a real memory, so that keys outnumber queries
    x, y = tokens[:, 5:11], tokens[:, 6:12]
    calls = []
    monkeypatch.setattr(_RecomputedAttention, "backward", lambda ctx, g, f=_RecomputedAttention.backward:
                        calls.append(1) or f(ctx, g))
    model(x, labels=y, memory=memory).loss.backward()
    assert len(calls) == model.config.n_layer
    recomputed = {n: p.grad.clone() for n, p in model.named_parameters()}
    for keep in ("recompute_attention=False", "dropatt"):
        model.zero_grad()
        for layer in model.layers:  # the explicit path, which keeps the probabilities
            if keep == "dropatt":
                layer.attn.recompute, layer.attn.dropatt.p = True, 1e-12  # drops nothing
            else:
                layer.attn.recompute = False
        model(x, labels=y, memory=memory).loss.backward()
        assert len(calls) == model.config.n_layer  # the dropatt path is autograd's, not a kernel's
        for name, p in model.named_parameters():
            torch.testing.assert_close(recomputed[name], p.grad, **TOL, msg=f"{keep}: {name}")


@pytest.mark.parametrize("attn_type,recompute", [("relative", True), ("relative", False), ("shaw", True),
                                                  ("absolute", True), ("rotary", True)])
def test_bf16_autocast_training_step_tracks_fp32(attn_type, recompute):
    """bf16 autocast (CPU) runs forward and backward through every attention path; loss and gradients stay
    close to fp32's (the benchmark's 1e-2 loss criterion, on a tiny model)."""
    torch.manual_seed(0)
    model = tiny(attn_type, txl.ComputeConfig(recompute_attention=recompute)).train()
    tokens = torch.randint(0, 50, (2, 13))
    memory = model(tokens[:, :6]).memory
    x, y = tokens[:, 6:12], tokens[:, 7:13]
    losses, grads = [], []
    for enabled in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = model(x, labels=y, memory=memory).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert abs(losses[1] - losses[0]) < 1e-2
    assert torch.isfinite(grads[1]).all()
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1].float(), dim=0)
    assert cosine > 0.99
