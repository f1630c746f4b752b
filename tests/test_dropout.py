"""Dropout: the cheaper masks ('fast32', the default, and 'fast16') and nn.Dropout ('torch'): identity in evaluation,
the right drop rate, unbiased, reproducible, exact gradient; 'fast32' keeps nn.Dropout's distribution and scale."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from torch import nn

import txl
from txl.model.dropout import FastDropout as Dropout
from txl.model.dropout import FastReLUDropout, ReLUDropout, keep_mask


def test_identity_in_eval_and_at_zero():
    x = torch.randn(4, 5)
    assert Dropout(0.3).eval()(x) is x
    assert Dropout(0.0).train()(x) is x


def test_drop_rate_and_expectation_16_bits():
    keep, scale = keep_mask(torch.Size([1_000_000]), 0.1, torch.device("cpu"), bits=16)
    assert abs(keep.float().mean().item() - 0.9) < 2e-3  # ~6 standard deviations
    assert abs(scale * (65536 - round(0.1 * 65536)) / 65536 - 1) < 1e-12  # scale = 1 / P(keep), exactly
    out = Dropout(0.1, bits=16).train()(torch.ones(1_000_000))
    assert abs(out.mean().item() - 1.0) < 3e-3
    assert set(out.unique().tolist()) == {0.0, torch.tensor(scale).item()}  # scale in float32


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-6])
def test_32_bit_mask_drops_below_the_threshold_of_p(p):
    """An element is dropped exactly when its 32-bit draw is among the lowest round(p * 2**32) of 2**32 values:
    P(drop) is p to within 2**-33. The draws are the generator's int64 stream read as int32 pairs."""
    n = 100_001  # odd: the last int64 is half used
    torch.manual_seed(11)
    keep, scale = keep_mask(torch.Size([n]), p, torch.device("cpu"), bits=32)
    torch.manual_seed(11)
    draws = torch.empty((n + 1) // 2, dtype=torch.int64).random_(-(2**63), None).view(torch.int32)[:n].long()
    assert torch.equal(keep, draws + 2**31 >= round(p * 2**32))
    assert scale == 1.0 / (1.0 - p)  # nn.Dropout's scale, not the quantised one
    assert abs(keep.float().mean().item() - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5 + 1e-9


def test_32_bit_dropout_scales_as_nn_dropout():
    """'fast32' keeps what nn.Dropout keeps, scaled the same, in float32; every element, every rate."""
    x = torch.randn(200_000)
    for p in (0.1, 0.25, 0.7):
        ours, theirs = Dropout(p).train()(x), F.dropout(x, p, training=True)
        kept, kept_t = ours != 0, theirs != 0
        torch.testing.assert_close(ours[kept], x[kept] / (1 - p), rtol=1e-6, atol=0)
        torch.testing.assert_close(theirs[kept_t], x[kept_t] / (1 - p), rtol=1e-6, atol=0)
        assert abs(kept.float().mean().item() - kept_t.float().mean().item()) < 6 * (2 * p * (1 - p) / x.numel()) ** 0.5


@pytest.mark.parametrize("module", [Dropout, FastReLUDropout])
def test_p_one_drops_everything_as_nn_dropout(module):
    x = torch.rand(5, 7) + 0.1
    for bits in (16, 32):
        assert torch.equal(module(1.0, bits=bits).train()(x), torch.zeros_like(x))


def test_torch_kernel_where_the_mask_would_not_pay():
    """32 bits off the CPU: torch's fused kernel (same distribution); 16 bits: the mask everywhere."""
    meta = torch.empty(3, device="meta")
    assert Dropout(0.1).torch_kernel(meta) and not Dropout(0.1, bits=16).torch_kernel(meta)
    assert not Dropout(0.1).torch_kernel(torch.empty(3)) and Dropout(1.0).torch_kernel(torch.empty(3))


@pytest.mark.parametrize("bits", [16, 32])
def test_odd_shapes_and_reproducible(bits):
    x = torch.randn(3, 7, 5)
    torch.manual_seed(3)
    a = Dropout(0.5, bits=bits).train()(x)
    torch.manual_seed(3)
    b = Dropout(0.5, bits=bits).train()(x)
    assert a.shape == x.shape and torch.equal(a, b)


@pytest.mark.parametrize("bits", [16, 32])
def test_gradient_is_the_mask_times_scale(bits):
    x = torch.randn(6, 9, requires_grad=True)
    weight = torch.randn(6, 9)
    out = Dropout(0.25, bits=bits).train()(x)
    (out * weight).sum().backward()
    kept = out != 0
    scale = 65536 / (65536 - round(0.25 * 65536)) if bits == 16 else 1 / 0.75
    torch.testing.assert_close(out, torch.where(kept, x * scale, 0))
    torch.testing.assert_close(x.grad, torch.where(kept, weight * scale, 0))


@pytest.mark.parametrize("bits", [16, 32])
def test_relu_dropout_equals_dropout_of_relu(bits):
    x = torch.randn(5, 33, requires_grad=True)
    weight = torch.randn(5, 33)
    torch.manual_seed(7)
    fused = FastReLUDropout(0.2, bits=bits).train()(x)
    (fused * weight).sum().backward()
    grad, x.grad = x.grad, None
    torch.manual_seed(7)
    plain = Dropout(0.2, bits=bits).train()(torch.relu(x))
    (plain * weight).sum().backward()
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)
    torch.testing.assert_close(grad, x.grad, atol=0, rtol=0)
    assert torch.equal(FastReLUDropout(0.2).eval()(x), torch.relu(x))


def test_inplace_relu_dropout_overwrites_its_input_only_without_dropout():
    x = torch.randn(4, 9)
    y = x.clone()
    assert FastReLUDropout(0.2, inplace=True).eval()(y) is y and torch.equal(y, torch.relu(x))
    y = x.clone()
    assert torch.equal(FastReLUDropout(0.0, inplace=True).train()(y), torch.relu(x)) and torch.equal(y, torch.relu(x))
    y = x.clone()
    FastReLUDropout(0.2, inplace=True).train()(y)
    assert torch.equal(y, x)  # with dropout the input is left alone


@pytest.mark.parametrize("impl, plain, relu, bits", [("fast32", Dropout, FastReLUDropout, 32),
                                                     ("torch", nn.Dropout, ReLUDropout, None),
                                                     ("fast16", Dropout, FastReLUDropout, 16)])
def test_dropout_impl_chooses_the_modules(impl, plain, relu, bits):
    model = txl.TransformerXL(tiny_config(dropout=0.1, dropout_impl=impl))  # with dropout: the modules exist
    assert type(model.drop) is plain and type(model.layers[0].attn.drop) is plain
    assert type(model.layers[0].ff.relu_drop) is relu and model.layers[0].ff.relu_drop.p == 0.1
    assert getattr(model.drop, "bits", None) == bits and getattr(model.layers[0].ff.relu_drop, "bits", None) == bits


def test_the_default_model_draws_32_bit_masks():
    model = txl.TransformerXL(tiny_config(dropout=0.1))
    assert all(type(m) in (Dropout, FastReLUDropout) and m.bits == 32 for m in model.modules()
               if isinstance(m, nn.Dropout))


def test_torch_dropout_is_nn_dropout_exactly():
    """'torch': exactly p and torch's own stream, the draws F.dropout makes from the same seed."""
    x = torch.randn(7, 13, requires_grad=True)
    torch.manual_seed(5)
    got = ReLUDropout(0.1).train()(x)
    torch.manual_seed(5)
    want = F.dropout(torch.relu(x), 0.1, training=True)
    assert torch.equal(got, want)
    assert torch.equal(ReLUDropout(0.1).eval()(x), torch.relu(x))
