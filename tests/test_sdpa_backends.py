"""The fused attention runs SDPA on the kernels that suit a dense bias and a changing key length (issue 34).

A spy in place of ``F.scaled_dot_product_attention`` reads torch's backend flags at the moment of each call:
off the CPU (meta tensors here, CUDA on a GPU) cuDNN's kernel is switched off for the call (it builds a plan
for every new shape and stride) and the memory-efficient, flash and math ones stay on; the flags are
restored after it; on a CPU the call is made as is.
"""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.flex_attention import relative_bias
from txl.model import kernels
from txl.model.positions import attention_mask

B, H, T, M, D = 2, 3, 4, 6, 8
FLAGS = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled, "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
         "flash": torch.backends.cuda.flash_sdp_enabled, "math": torch.backends.cuda.math_sdp_enabled}


@pytest.fixture
def calls(monkeypatch):
    """Each SDPA call's backend flags and mask shape, in order; the real kernel still computes the result."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(dict({name: flag() for name, flag in FLAGS.items()}, mask=tuple(attn_mask.shape),
                         device=q.device.type))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def inputs(device: str, requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, M + T, H, D, generator=g), torch.randn(B, M + T, H, D, generator=g)
    qv, r = torch.randn(H, B * T, D, generator=g), torch.randn(M + T, H, D, generator=g)
    out = [t.to(device).requires_grad_(requires_grad) for t in (q, k, v, qv, r)]
    mask = attention_mask(T, M, mem_len=M, same_length=False, style="pytorch", device=device)  # (T, K)
    return (*out, mask)


PINNED = dict(cudnn=False, efficient=True, flash=True, math=True)


@pytest.mark.parametrize("case", ["bias", "no-bias", "recompute"])
def test_off_the_cpu_sdpa_runs_without_cudnn_and_the_flags_come_back(calls, case, monkeypatch):
    q, k, v, qv, r, mask = inputs("meta", requires_grad=case == "recompute")
    if case == "recompute":  # training's forward; torch keeps no autocast state for 'meta', so it saves a CPU one
        monkeypatch.setattr(kernels, "_forward_autocast", lambda device: dict(device_type="cpu", enabled=False))
    before = {name: flag() for name, flag in FLAGS.items()}
    bias = dict(bias_fn=relative_bias, bias_inputs=(qv, r)) if case != "no-bias" else {}
    with torch.set_grad_enabled(case == "recompute"):
        out = kernels.fused_attention(q, k, v, mask=mask, **bias)
    assert out.shape == (B, H, T, D) and out.device.type == "meta"
    assert len(calls) == 1
    call = calls[0]
    assert {name: call[name] for name in FLAGS} == PINNED
    assert call["mask"] == ((B, H, T, M + T) if case != "no-bias" else (T, M + T))  # a dense bias, or the bool mask
    assert {name: flag() for name, flag in FLAGS.items()} == before  # restored after the call


def test_on_a_cpu_the_call_is_made_as_is_and_equals_the_pinned_one(calls):
    """No context on a CPU (nothing to keep out there: the CPU's plan says pin=False); the pinned call computes the
    same numbers."""
    q, k, v, qv, r, mask = inputs("cpu")
    before = {name: flag() for name, flag in FLAGS.items()}
    got = kernels.fused_attention(q, k, v, mask=mask, bias_fn=relative_bias, bias_inputs=(qv, r), pin=False)
    assert {name: calls[0][name] for name in FLAGS} == before
    bias = relative_bias(qv, r, mask_bias=kernels.mask_to_bias(mask, q.dtype))  # (B, H, T, K)
    with torch.nn.attention.sdpa_kernel(list(kernels.SDPA_BACKENDS)):
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=bias, scale=1.0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_the_pinned_kernels_leave_out_only_cudnn():
    from torch.nn.attention import SDPBackend
    assert set(kernels.SDPA_BACKENDS) == {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH}
