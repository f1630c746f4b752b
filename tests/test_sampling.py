import math

import pytest
import torch

from txl.sampling import apply_temperature, sample_next, top_k_filter, top_p_filter

NEG_INF = float("-inf")


def kept(filtered: torch.Tensor) -> list[list[bool]]:
    return torch.isfinite(filtered).tolist()


def test_apply_temperature_scales_and_changes_sharpness():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    torch.testing.assert_close(apply_temperature(logits, 2.0), torch.tensor([[0.5, 1.0, 2.0]]))
    cold = torch.softmax(apply_temperature(logits, 0.5), -1)
    hot = torch.softmax(apply_temperature(logits, 5.0), -1)
    assert cold.max() > torch.softmax(logits, -1).max() > hot.max()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_apply_temperature_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(torch.zeros(1, 3), bad)


def test_top_k_exact_mask():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = top_k_filter(logits, 2)
    assert kept(out) == [[False, True, False, True, False], [True, True, False, False, False]]
    # Kept values are untouched, the input is not modified.
    assert out[0, 1] == 3.0 and out[0, 3] == 2.0
    assert torch.isfinite(logits).all()


def test_top_k_keeps_ties_and_disables():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert kept(top_k_filter(logits, 1)) == [[False, True, True, False]]
    torch.testing.assert_close(top_k_filter(logits, 0), logits)
    torch.testing.assert_close(top_k_filter(logits, 10), logits)


def test_top_k_works_on_any_leading_shape():
    logits = torch.arange(24.0).view(2, 3, 4)
    out = top_k_filter(logits, 3)
    assert kept(out)[1][2] == [False, True, True, True]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_top_k_rejects_bad_k(bad):
    with pytest.raises(ValueError, match="top_k"):
        top_k_filter(torch.zeros(1, 3), bad)


def test_top_p_exact_mask():
    # Probabilities 0.5, 0.25, 0.15, 0.1 in a shuffled vocabulary order.
    probs = torch.tensor([[0.15, 0.5, 0.1, 0.25]])
    logits = probs.log()
    # p=0.6: 0.5 alone is < 0.6, 0.5+0.25 crosses it -> keep those two.
    assert kept(top_p_filter(logits, 0.6)) == [[False, True, False, True]]
    # p=0.8: needs 0.5+0.25+0.15.
    assert kept(top_p_filter(logits, 0.8)) == [[True, True, False, True]]
    # Tiny p keeps only the top token; p=1 keeps everything.
    assert kept(top_p_filter(logits, 1e-6)) == [[False, True, False, False]]
    assert kept(top_p_filter(logits, 1.0)) == [[True, True, True, True]]


def test_top_p_renormalised_distribution():
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    probs = torch.softmax(top_p_filter(logits, 0.7), -1)
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_top_p_keeps_top_token_with_dominant_logit_and_log_probs():
    logits = torch.tensor([[100.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    out = top_p_filter(torch.log_softmax(logits, -1), 0.5)
    assert kept(out) == [[True, False, False], [False, False, True]]


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01])
def test_top_p_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(torch.zeros(1, 3), bad)


def test_greedy_at_temperature_zero():
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.0]])
    out = sample_next(logits, temperature=0.0, top_k=2, top_p=0.5)
    assert out.dtype == torch.int64 and out.tolist() == [1, 0]


def test_seeded_generator_is_deterministic():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    draws = [
        sample_next(logits, temperature=0.9, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert draws[0].shape == (4,) and draws[0].dtype == torch.int64
    assert torch.equal(draws[0], draws[1])
    # A different seed gives a different sequence of draws somewhere over many rows.
    many = logits.repeat(50, 1)
    a = sample_next(many, generator=torch.Generator().manual_seed(1))
    b = sample_next(many, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(a, b)


def test_filters_are_respected_by_sampling():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    out = sample_next(logits, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(out.tolist()) == {0, 1}
    out = sample_next(logits, top_p=1e-3, generator=torch.Generator().manual_seed(0))
    assert set(out.tolist()) == {0}


def test_empirical_frequencies_match_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0])
    n = 20000
    out = sample_next(logits.repeat(n, 1), temperature=1.0, generator=torch.Generator().manual_seed(123))
    freq = torch.bincount(out, minlength=4).double() / n
    expected = torch.softmax(logits.double(), -1)
    # ~5 standard errors of a binomial proportion: fails only if the sampler is wrong.
    tol = 5 * math.sqrt(0.25 / n)
    assert (freq - expected).abs().max() < tol


def test_temperature_changes_empirical_distribution():
    logits = torch.tensor([1.0, 0.0]).repeat(5000, 1)
    hot = sample_next(logits, temperature=10.0, generator=torch.Generator().manual_seed(0))
    freq1 = hot.float().mean().item()  # fraction of token 1
    expected = torch.softmax(torch.tensor([0.1, 0.0]), -1)[1].item()
    assert abs(freq1 - expected) < 0.035


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_sample_next_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_next(torch.zeros(2, 3), **kwargs)


@pytest.mark.parametrize("shape", [(3,), (1, 2, 3)])
def test_sample_next_rejects_wrong_rank(shape):
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample_next(torch.zeros(shape))


def test_rejects_integer_logits():
    with pytest.raises(ValueError, match="floating-point"):
        sample_next(torch.zeros(2, 3, dtype=torch.long))
