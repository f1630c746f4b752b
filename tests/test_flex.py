"""FlexAttention with the relative term as a score_mod (benchmarks.flex_attention) against the fused kernel and the
reference.

On a CPU the forward (torch runs FlexAttention unfused there, and has no backward for it); on CUDA (``-m gpu``)
the compiled kernel's forward and every gradient, through the captured positional table to q + v and W_kR R.
"""

import warnings

import pytest
import torch

from benchmarks.flex_attention import relative_bias, relative_flex_attention
from txl.model import kernels
from txl.model.positions import attention_mask, rel_shift

H, D = 3, 8
CUDA_D = 16  # FlexAttention's smallest head width on CUDA


def operands(B: int, T: int, M: int, device: str = "cpu", requires_grad: bool = False, d: int = D):
    g = torch.Generator().manual_seed(T * 100 + M)
    K = M + T
    tensors = [torch.randn(B, T, H, d, generator=g), torch.randn(B, K, H, d, generator=g),
               torch.randn(B, K, H, d, generator=g), torch.randn(H, B * T, d, generator=g),
               torch.randn(K, H, d, generator=g)]
    return [t.to(device).requires_grad_(requires_grad) for t in tensors]


def reference(query, k, val, qv, r):
    """The paper's scores term by term: (a)+(c) content, (b)+(d) by distance realigned by rel_shift, causal."""
    B, T = query.shape[:2]
    K = k.size(1)
    content = torch.einsum("bthd,bkhd->bhtk", query, k)  # (B, H, T, K)
    position = torch.einsum("hbtd,khd->bhtk", qv.view(H, B, T, -1), r)  # (B, H, T, K) by distance
    mask = attention_mask(T, K - T, mem_len=K - T, same_length=False, style="pytorch", device=query.device)
    score = (content + rel_shift(position)).masked_fill(mask, float("-inf"))
    return torch.einsum("bhtk,bkhd->bhtd", torch.softmax(score, dim=-1), val)  # (B, H, T, D)


@pytest.mark.parametrize("T,M,d", [(5, 0, D), (5, 4, D), (3, 9, D), (7, 7, D), (64, 192, CUDA_D)],
                         ids=["no-memory", "memory", "long", "equal", "cuda-shape"])
def test_flex_forward_equals_the_fused_kernel_and_the_reference(T, M, d):
    """The forward; 'cuda-shape': the CUDA test's operands (head width 16), its CPU twin (fp32: no dtype rule to
    check; the CPU has no FlexAttention backward)."""
    query, k, val, qv, r = operands(2, T, M, d=d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention says it runs unfused
        got = relative_flex_attention(query, k, val, qv, r)
    mask = attention_mask(T, M, mem_len=M, same_length=False, style="pytorch")
    fused = kernels.fused_attention(query, k, val, mask=mask, bias_fn=relative_bias, bias_inputs=(qv, r))
    assert got.shape == (2, H, T, d)
    torch.testing.assert_close(got, fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, reference(query, k, val, qv, r), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T,M", [(64, 192)])
def test_compiled_flex_forward_and_gradients_equal_the_reference_on_cuda(T, M):
    from torch.nn.attention.flex_attention import flex_attention

    from txl.runtime import matmul_precision

    attend = torch.compile(flex_attention, dynamic=False)
    with matmul_precision(torch.device("cuda"), tf32=False):
        inputs = operands(2, T, M, "cuda", requires_grad=True, d=CUDA_D)
        got = relative_flex_attention(*inputs, attend=attend)
        want = reference(*inputs)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        grad = torch.randn_like(want)
        for a, b, name in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad),
                              ("query", "k", "val", "qv", "r"), strict=True):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3, msg=name)
