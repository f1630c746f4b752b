"""Dropout: the cheaper sampler ('fast', the default, drawing the gaps between dropped elements) and
nn.Dropout ('torch'): identity in evaluation, nn.Dropout's distribution and scale, independence, reproducible,
exact gradients."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

import txl
from txl.config import RunConfig
from txl.model.dropout import Dropout, rare_positions


def relu_dropout(p: float) -> Dropout:
    return Dropout(p, relu=True)


def torch_dropout(p: float, *, relu: bool = False) -> Dropout:
    """What dropout_impl='torch' (or a device off the CPU) builds: the sampler off."""
    module = Dropout(p, relu=relu)
    module.gaps = False
    return module


def test_identity_in_eval_and_at_zero():
    x = torch.randn(4, 5)
    assert Dropout(0.3).eval()(x) is x
    assert Dropout(0.0).train()(x) is x


@pytest.mark.parametrize("p", [0.02, 0.1, 0.3, 0.5, 0.7, 0.95])
def test_gaps_give_independent_drops_at_rate_p(p):
    """nn.Dropout's distribution: each element dropped with probability p, independently of its neighbour
    (a pair differs with probability 2 p (1 - p)), and P(drop | the previous one dropped) = p."""
    n = 2_000_000
    torch.manual_seed(0)
    out = Dropout(p).train()(torch.ones(n))
    dropped = out == 0
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(dropped.float().mean().item() - p) < 6 * sd
    changes = (dropped[1:] != dropped[:-1]).float().mean().item()
    assert abs(changes - 2 * p * (1 - p)) < 6 * math.sqrt(2 * p * (1 - p) / n) * 2
    after_drop = dropped[1:][dropped[:-1]].float().mean().item()
    assert abs(after_drop - p) < 6 * math.sqrt(p * (1 - p) / (p * n))
    assert torch.equal(out[~dropped], torch.full_like(out[~dropped], 1 / (1 - p)))  # nn.Dropout's scale


@pytest.mark.parametrize("q", [1e-5, 0.1, 0.5])
def test_rare_positions_are_sorted_and_independent_of_the_chunk_size(q):
    """The process has no memory: drawn in chunks of 3 it continues where each chunk ended, so the positions
    are the ones one big chunk gives from the same stream."""
    n = 20_001
    torch.manual_seed(4)
    whole = rare_positions(n, q, torch.device("cpu"))
    torch.manual_seed(4)
    chunked = rare_positions(n, q, torch.device("cpu"), first=3)
    assert torch.equal(whole, chunked)
    assert whole.dtype == torch.int64 and (whole.numel() == 0 or (0 <= whole[0] and whole[-1] < n))
    assert bool((whole[1:] > whole[:-1]).all())


@pytest.mark.parametrize("p", [0.1, 0.7])
def test_gaps_keep_what_nn_dropout_keeps_scaled_the_same(p):
    x = torch.randn(300_000)
    ours, theirs = Dropout(p).train()(x), F.dropout(x, p, training=True)
    kept, kept_t = ours != 0, theirs != 0
    torch.testing.assert_close(ours[kept], x[kept] / (1 - p), rtol=1e-6, atol=0)
    torch.testing.assert_close(theirs[kept_t], x[kept_t] / (1 - p), rtol=1e-6, atol=0)
    assert abs(kept.float().mean().item() - kept_t.float().mean().item()) < 6 * math.sqrt(2 * p * (1 - p) / x.numel())


@pytest.mark.parametrize("module", [Dropout, relu_dropout, torch_dropout])
def test_p_one_drops_everything_as_nn_dropout(module):
    x = torch.rand(5, 7) + 0.1
    assert torch.equal(module(1.0).train()(x), torch.zeros_like(x))


def test_torch_kernel_where_the_sampler_would_not_pay():
    """Gaps where the model's plan says (the CPU's); elsewhere torch's fused kernel (same distribution): a model
    moved off the CPU switches its modules over (here to 'meta')."""
    model = txl.TransformerXL(tiny_config(dropout=0.1))
    assert model.drop.gaps and model.layers[0].ff.relu_drop.gaps
    model.to("meta")
    assert not model.drop.gaps and not model.layers[0].ff.relu_drop.gaps


def test_odd_shapes_and_reproducible():
    x = torch.randn(3, 7, 5)
    torch.manual_seed(3)
    a = Dropout(0.5).train()(x)
    torch.manual_seed(3)
    b = Dropout(0.5).train()(x)
    assert a.shape == x.shape and torch.equal(a, b)


@pytest.mark.parametrize("p", [0.25, 0.8])
def test_gradient_is_the_mask_times_scale(p):
    x = torch.randn(6, 9, requires_grad=True)
    weight = torch.randn(9, 6).t()  # a non-contiguous gradient
    out = Dropout(p).train()(x)
    (out * weight).sum().backward()
    kept = out != 0
    scale = 1 / (1 - p)
    torch.testing.assert_close(out, torch.where(kept, x * scale, 0))
    torch.testing.assert_close(x.grad, torch.where(kept, weight * scale, 0))


@pytest.mark.parametrize("p", [0.2, 0.8])
def test_relu_dropout_equals_dropout_of_relu(p):
    x = torch.randn(5, 33, requires_grad=True)
    weight = torch.randn(5, 33)
    torch.manual_seed(7)
    fused = relu_dropout(p).train()(x)
    (fused * weight).sum().backward()
    grad, x.grad = x.grad, None
    torch.manual_seed(7)
    plain = Dropout(p).train()(torch.relu(x))
    (plain * weight).sum().backward()
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)
    torch.testing.assert_close(grad, x.grad, atol=0, rtol=0)
    assert torch.equal(relu_dropout(p).eval()(x), torch.relu(x))


@pytest.mark.parametrize("impl", ["fast", "torch"])
def test_dropout_impl_chooses_the_sampler(impl):
    model = txl.TransformerXL(tiny_config(dropout=0.1), txl.ComputeConfig(dropout_impl=impl))  # with dropout
    modules = [model.drop, model.layers[0].attn.drop, model.layers[0].ff.relu_drop]
    assert all(type(m) is Dropout and m.p == 0.1 and m.gaps == (impl == "fast") for m in modules)
    assert model.layers[0].ff.relu_drop.relu and not model.drop.relu


def test_a_saved_fast16_config_reads_as_fast():
    """'fast16' is gone (issue 45): a saved config that names it (and the retired state_dtype, residual_dtype)
    loads, as 'fast'."""
    saved = {**tiny_config().to_dict(), "dropout_impl": "fast16", "state_dtype": "compute", "residual_dtype": "auto"}
    run = RunConfig.from_dict({"model": saved})
    assert run.compute.dropout_impl == "fast" and not hasattr(run.model, "state_dtype")
    with pytest.raises(ValueError, match="dropout_impl='fast16' is unknown"):
        txl.ComputeConfig(dropout_impl="fast16")


def test_torch_dropout_is_nn_dropout_exactly():
    """'torch': exactly p and torch's own stream, the draws F.dropout makes from the same seed."""
    x = torch.randn(7, 13, requires_grad=True)
    torch.manual_seed(5)
    got = torch_dropout(0.1, relu=True).train()(x)
    torch.manual_seed(5)
    want = F.dropout(torch.relu(x), 0.1, training=True)
    assert torch.equal(got, want)
    assert torch.equal(torch_dropout(0.1, relu=True).eval()(x), torch.relu(x))
