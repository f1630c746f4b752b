"""Dropout: nn.Dropout by default; the cheaper kernel ('fast16'): identity in evaluation, the right drop rate,
unbiased, reproducible, exact gradient."""

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


def test_drop_rate_and_expectation():
    keep, scale = keep_mask(torch.Size([1_000_000]), 0.1, torch.device("cpu"))
    assert abs(keep.float().mean().item() - 0.9) < 2e-3  # ~6 standard deviations
    assert abs(scale * (65536 - round(0.1 * 65536)) / 65536 - 1) < 1e-12  # scale = 1 / P(keep), exactly
    out = Dropout(0.1).train()(torch.ones(1_000_000))
    assert abs(out.mean().item() - 1.0) < 3e-3
    assert set(out.unique().tolist()) == {0.0, torch.tensor(scale).item()}  # scale in float32


def test_odd_shapes_and_reproducible():
    x = torch.randn(3, 7, 5)
    torch.manual_seed(3)
    a = Dropout(0.5).train()(x)
    torch.manual_seed(3)
    b = Dropout(0.5).train()(x)
    assert a.shape == x.shape and torch.equal(a, b)


def test_gradient_is_the_mask_times_scale():
    x = torch.randn(6, 9, requires_grad=True)
    weight = torch.randn(6, 9)
    out = Dropout(0.25).train()(x)
    (out * weight).sum().backward()
    kept = out != 0
    scale = 65536 / (65536 - round(0.25 * 65536))
    torch.testing.assert_close(out, torch.where(kept, x * scale, 0))
    torch.testing.assert_close(x.grad, torch.where(kept, weight * scale, 0))


def test_relu_dropout_equals_dropout_of_relu():
    x = torch.randn(5, 33, requires_grad=True)
    weight = torch.randn(5, 33)
    torch.manual_seed(7)
    fused = FastReLUDropout(0.2).train()(x)
    (fused * weight).sum().backward()
    grad, x.grad = x.grad, None
    torch.manual_seed(7)
    plain = Dropout(0.2).train()(torch.relu(x))
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


@pytest.mark.parametrize("impl, plain, relu", [("torch", nn.Dropout, ReLUDropout),
                                               ("fast16", Dropout, FastReLUDropout)])
def test_dropout_impl_chooses_the_modules(impl, plain, relu):
    model = txl.TransformerXL(tiny_config(dropout=0.1, dropout_impl=impl))  # with dropout: the modules exist
    assert type(model.drop) is plain and type(model.layers[0].attn.drop) is plain
    assert type(model.layers[0].ff.relu_drop) is relu and model.layers[0].ff.relu_drop.p == 0.1


def test_default_dropout_is_nn_dropout_exactly():
    """'torch': exactly p and torch's own stream, the draws F.dropout makes from the same seed."""
    x = torch.randn(7, 13, requires_grad=True)
    torch.manual_seed(5)
    got = ReLUDropout(0.1).train()(x)
    torch.manual_seed(5)
    want = F.dropout(torch.relu(x), 0.1, training=True)
    assert torch.equal(got, want)
    assert torch.equal(ReLUDropout(0.1).eval()(x), torch.relu(x))
