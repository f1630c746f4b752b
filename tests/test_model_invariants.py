"""Properties the model must have whatever its weights: recurrence, shifting, normalisation, purity."""

import pytest
import torch
from conftest import ATTN_TYPES, tiny_config

import txl
from txl.model import kernels
from txl.model.kernels import realign
from txl.model.positions import Positions, attention_mask, rel_shift, relative_distances, sinusoid


def model_of(**overrides) -> txl.TransformerXL:
    return txl.TransformerXL(tiny_config(**overrides)).eval()  # vocab 61, d_model 32, 4 heads of 8


@pytest.mark.parametrize("variant", [
    dict(), dict(cutoffs=[10, 30], div_val=2, d_embed=32), dict(pre_ln=True), dict(untie_r=True),
    dict(attn_type="shaw", learned_positions=64), dict(clamp_len=5), dict(attn_type="rotary"),
])
def test_segments_with_memory_equal_one_long_pass(variant):
    """Whenever memory covers the history, recurrence is exactly a longer causal context."""
    total, seg = 24, 6
    model = model_of(mem_len=total, **variant)
    tokens = torch.randint(0, 61, (2, total + 1))
    with torch.no_grad():
        full = model(tokens[:, :total], labels=tokens[:, 1:]).nll
        memory, parts = None, []
        for s in range(0, total, seg):
            out = model(tokens[:, s:s + seg], labels=tokens[:, s + 1:s + seg + 1], memory=memory)
            memory = out.memory
            parts.append(out.nll)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_memory_is_truncated_to_mem_len_and_holds_layer_inputs():
    model = model_of(mem_len=5)
    tokens = torch.randint(0, 61, (3, 8))
    with torch.no_grad():
        out = model(tokens[:, :4])
        assert [m.shape for m in out.memory] == [torch.Size([3, 4, 32])] * 2
        out2 = model(tokens[:, 4:], memory=out.memory)
    assert [m.shape for m in out2.memory] == [torch.Size([3, 5, 32])] * 2
    # Layer 0's memory is its input: the scaled embedding of the last 5 tokens.
    torch.testing.assert_close(out2.memory[0], model.embed(tokens[:, 3:]))


def test_ext_len_positions_are_not_written_to_memory():
    model = model_of(mem_len=10, ext_len=2)
    tokens = torch.randint(0, 61, (1, 6))
    with torch.no_grad():
        out = model(tokens)
    assert out.memory[0].size(1) == 4
    torch.testing.assert_close(out.memory[0], model.embed(tokens[:, :4]))


def test_rel_shift_equals_explicit_gather():
    B, H, T, M = 2, 3, 5, 4
    K = M + T
    x = torch.randn(B, H, T, K)
    shifted = rel_shift(x)
    for i in range(T):
        for j in range(M + i + 1):  # visible keys; the rest is masked and meaningless
            p = K - 1 - (M + i - j)  # encoding index of distance M+i-j
            torch.testing.assert_close(shifted[:, :, i, j], x[:, :, i, p])


def test_relative_scores_use_R_of_the_true_distance():
    """Terms (b)+(d) of query i and key j are (q_i + v) . W_kR R(i - j) for every visible pair, in the reference's
    rel_shift and in the fused path's realigned bias (which also carries 1/sqrt(D) and -inf where hidden)."""
    model = model_of(mem_len=4)
    attn = model.layers[0].attn
    B, T, M, H, D = 1, 3, 4, 4, 8
    K = M + T
    q = torch.randn(B, T, H, D)
    positions = Positions(encodings=sinusoid(relative_distances(K, -1), 32))
    mask = attention_mask(T, M, mem_len=M, same_length=False, style="pytorch")
    reference = rel_shift(attn.position_scores(q, K, positions, model.v))  # (B, H, T, K)
    operands = attn.positional_operands(q, K, positions, model.v)
    fused = kernels.positional_bias(attn.scores_of, *operands, mask_bias=kernels.mask_to_bias(mask, q.dtype),
                                    scale=attn.scale) / attn.scale  # (B, H, T, K)
    r = attn.r_proj(sinusoid(torch.arange(K), 32)).view(K, H, D)  # row n: distance n
    for i in range(T):
        for j in range(K):
            if j > M + i:
                assert torch.isneginf(fused[0, :, i, j]).all()
                continue
            expected = ((q[0, i] + model.v) * r[M + i - j]).sum(-1)
            torch.testing.assert_close(reference[0, :, i, j], expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fused[0, :, i, j], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 0.375])
@pytest.mark.parametrize("heads_first", [True, False])
def test_realign_equals_rel_shift_plus_mask_with_its_gradient(heads_first, scale):
    """The pad-free realign (custom backward) against rel_shift written with autograd's own ops; ``scale``: the
    scores scaled in the same pass (the attention's 1/sqrt(D), issue 34), forward and backward."""
    A, C, T, M = 3, 2, 5, 4
    K = M + T
    scores = torch.randn(A, C, T, K, dtype=torch.float64)
    ours = scores.clone().requires_grad_()
    reference_in = scores.clone().requires_grad_()
    mask = attention_mask(T, M, mem_len=3, same_length=True, style="pytorch")
    mask_bias = torch.zeros(T, K, dtype=torch.float64).masked_fill_(mask, float("-inf"))
    got = realign(ours, mask_bias, heads_first=heads_first, scale=scale)  # (B, H, T, K)
    want = rel_shift(reference_in)
    want = (want.transpose(0, 1) if heads_first else want) * scale + mask_bias
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(got[~torch.isneginf(got)], want[~torch.isneginf(want)], rtol=0, atol=0)
    # Hidden entries get no gradient in the model (probability 0); there both shifts agree exactly ...
    upstream = torch.randn_like(got).masked_fill_(torch.isneginf(got), 0)
    got.backward(upstream)
    want.backward(upstream)
    torch.testing.assert_close(ours.grad, reference_in.grad, rtol=0, atol=1e-15)
    # ... and for any upstream gradient the backward is the exact gradient of the forward.
    assert torch.autograd.gradcheck(lambda x: realign(x, torch.zeros(T, K, dtype=torch.float64),
                                                      heads_first=heads_first, scale=scale), (scores.requires_grad_(),))


def test_clamp_len_shares_far_encodings():
    d = relative_distances(10, 3)
    assert d.tolist() == [3] * 7 + [2, 1, 0]
    R = sinusoid(d, 16)
    torch.testing.assert_close(R[0], R[6])


@pytest.mark.parametrize("cfg", [dict(), dict(cutoffs=[10, 30]), dict(cutoffs=[7, 20, 40], div_val=2),
                                 dict(d_embed=16)])
def test_log_probs_normalise_and_match_nll(cfg):
    model = model_of(**cfg)
    tokens = torch.randint(0, 61, (2, 7))
    labels = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        out = model(tokens, labels=labels, return_log_probs=True)
    torch.testing.assert_close(out.log_probs.logsumexp(-1), torch.zeros(2, 7), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.nll, -out.log_probs.gather(-1, labels[..., None]).squeeze(-1))
    torch.testing.assert_close(out.loss, out.nll.mean())


def test_ignored_labels_count_nothing():
    model = model_of()
    tokens = torch.randint(0, 61, (2, 6))
    labels = torch.randint(0, 61, (2, 6))
    masked = labels.clone()
    masked[:, :2] = -100
    with torch.no_grad():
        a = model(tokens, labels=labels)
        b = model(tokens, labels=masked)
    assert torch.all(b.nll[:, :2] == 0)
    torch.testing.assert_close(b.nll[:, 2:], a.nll[:, 2:])
    torch.testing.assert_close(b.loss, a.nll[:, 2:].mean())


def test_no_gradient_reaches_memory_and_memory_is_not_modified():
    model = model_of(mem_len=6, dropout=0.1).train()
    tokens = torch.randint(0, 61, (2, 12))
    memory = tuple(m.requires_grad_() for m in model.init_memory(2, 6))
    with torch.no_grad():
        memory = tuple(m.add_(torch.randn_like(m)) for m in memory)
    before = [m.clone() for m in memory]
    out = model(tokens[:, :6], labels=tokens[:, 1:7], memory=memory)
    out.loss.backward()
    assert all(m.grad is None for m in memory)
    assert all(torch.equal(a, b) for a, b in zip(memory, before, strict=True))
    assert all(not m.requires_grad for m in out.memory)


@pytest.mark.parametrize("attn_type", ATTN_TYPES)
@pytest.mark.parametrize("mem_len", [0, 8])
def test_ablation_variants_forward_and_backward(attn_type, mem_len):
    model = model_of(attn_type=attn_type, mem_len=mem_len, learned_positions=12, dropout=0.1).train()
    tokens = torch.randint(0, 61, (2, 19))
    memory = None
    for s in (0, 6, 12):  # klen grows past learned_positions: far positions reuse the last
        model.zero_grad()
        out = model(tokens[:, s:s + 6], labels=tokens[:, s + 1:s + 7], memory=memory)
        out.loss.backward()
        memory = out.memory
        assert torch.isfinite(out.loss)
        assert memory[0].size(1) == min(mem_len, s + 6)
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_causal_mask_hides_only_the_future():
    mask = attention_mask(3, 2, mem_len=2, same_length=False, style="pytorch")
    expected = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("style, seen", [("pytorch", 4), ("tensorflow", 5)])
def test_same_length_styles(style, seen):
    """With a full memory every query sees mem_len keys (PyTorch/HF) or mem_len + 1 (TF/NVIDIA)."""
    T, M = 5, 4
    mask = attention_mask(T, M, mem_len=M, same_length=True, style=style)
    assert ((~mask).sum(1) == seen).all()
    for i in range(T):  # the visible keys are the most recent ones, ending at the query itself
        visible = (~mask[i]).nonzero().squeeze(1)
        assert visible.max().item() == M + i
        assert visible.tolist() == list(range(M + i - seen + 1, M + i + 1))


def test_same_length_matches_tensorflow_definition():
    """The original TF _create_mask with same_length, written out with its band matrices."""
    T, M = 4, 4
    ones = torch.ones(T, T)
    upper, diag, lower = torch.triu(ones), torch.diag(torch.ones(T)), torch.tril(ones)
    tf = torch.cat([torch.zeros(T, M), upper - diag], 1)
    tf = torch.cat([tf[:, :T] + lower - diag, tf[:, T:]], 1) > 0
    assert torch.equal(attention_mask(T, M, mem_len=M, same_length=True, style="tensorflow"), tf)


def test_context_is_passed_in_and_leaves_the_config_alone():
    """A longer evaluation context is an argument, as the memory is: the same as a model built with it."""
    model = model_of(mem_len=4)
    wide = model_of(mem_len=16, clamp_len=8, same_length=True)
    wide.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 61, (2, 12))
    context = model.config.context(mem_len=16, clamp_len=8, same_length=True)
    assert context == wide.config.context()
    with torch.no_grad():
        a = model(tokens[:, :6], context=context)
        a = model(tokens[:, 6:], memory=a.memory, context=context)
        b = wide(tokens[:, :6])
        b = wide(tokens[:, 6:], memory=b.memory)
    torch.testing.assert_close(a.log_probs, b.log_probs)
    assert a.memory[0].size(1) == 12 and model.config.mem_len == 4
    with pytest.raises(ValueError, match="Context.mem_len=-1 must be an integer >= 0"):
        model.config.context(mem_len=-1)
    with pytest.raises(ValueError, match="context must be a txl.Context"):
        model(tokens, context=dict(mem_len=3))


def test_zero_memory_is_attended_to():
    model = model_of(mem_len=4)
    tokens = torch.randint(0, 61, (1, 5))
    with torch.no_grad():
        empty = model(tokens).log_probs
        zeros = model(tokens, memory=model.init_memory(1, 4)).log_probs
    assert not torch.allclose(empty, zeros)


@pytest.mark.parametrize("tie_weight", [True, False], ids=["tied", "untied"])
def test_every_cluster_gives_unused_clusters_zero_gradients_and_changes_nothing_else(tie_weight):
    """What FSDP needs (txl.parallel.shard sets it): with ``every_cluster`` a tail cluster no token falls in runs on
    no rows, so its parameters get zero gradients instead of none; the loss and every other gradient are the
    same, bit for bit."""
    config = tiny_config(vocab_size=60, cutoffs=[20, 40], div_val=2, d_embed=32, tie_weight=tie_weight)
    torch.manual_seed(0)
    model = txl.TransformerXL(config)
    torch.manual_seed(1)
    x = torch.randint(0, 20, (2, 5))  # inputs and labels in the head only: both tail clusters unused
    y = torch.randint(0, 20, (2, 5))
    grads = {}
    for every in (False, True):
        model.zero_grad(set_to_none=True)
        model.embed.every_cluster = model.softmax.every_cluster = every
        out = model(x, labels=y)
        out.loss.backward()
        grads[every] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss_skip, skip), (loss_all, every_) = grads[False], grads[True]
    assert torch.equal(loss_skip, loss_all)
    unused = [n for n, g in skip.items() if g is None]
    assert unused, "the test must leave some parameters without a gradient"
    for name, g in every_.items():
        assert g is not None, name
        if name in unused:
            assert not g.any(), name
        else:
            assert torch.equal(g, skip[name]), name
