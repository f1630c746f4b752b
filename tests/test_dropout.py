"""The cheaper dropout: identity in evaluation, the right drop rate, unbiased, reproducible, exact gradient."""

import torch

from txl.model.dropout import Dropout, ReLUDropout, keep_mask


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
    fused = ReLUDropout(0.2).train()(x)
    (fused * weight).sum().backward()
    grad, x.grad = x.grad, None
    torch.manual_seed(7)
    plain = Dropout(0.2).train()(torch.relu(x))
    (plain * weight).sum().backward()
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)
    torch.testing.assert_close(grad, x.grad, atol=0, rtol=0)
    assert torch.equal(ReLUDropout(0.2).eval()(x), torch.relu(x))


def test_inplace_relu_dropout_overwrites_its_input_only_without_dropout():
    x = torch.randn(4, 9)
    y = x.clone()
    assert ReLUDropout(0.2, inplace=True).eval()(y) is y and torch.equal(y, torch.relu(x))
    y = x.clone()
    assert torch.equal(ReLUDropout(0.0, inplace=True).train()(y), torch.relu(x)) and torch.equal(y, torch.relu(x))
    y = x.clone()
    ReLUDropout(0.2, inplace=True).train()(y)
    assert torch.equal(y, x)  # with dropout the input is left alone
