"""Every speed path (txl.model.kernels) against the reference attention (the paper's equation term by term).

attn_impl='fused' and attn_impl='reference' with the same weights: forward, gradients of inputs and parameters,
memories, every attention type, train and eval, same_length and clamp_len, the key/value cache; and the
model under torch.compile: no graph break, and the eager loss.
"""

import os

import pytest
import torch
from conftest import ATTN_TYPES, assert_training_equal, tiny_config

import txl
from txl.model.positions import attention_mask

TOL = dict(atol=1e-5, rtol=1e-5)
CONTEXTS = {"plain": dict(), "same_length": dict(same_length=True), "clamp_len": dict(clamp_len=3)}


def pair(attn_type: str, compute: txl.ComputeConfig | None = None,
         **changes) -> tuple[txl.TransformerXL, txl.TransformerXL]:
    """A fused model (computed as ``compute`` says) and a reference one with the same (perturbed, so that every bias
    matters) weights."""
    config = tiny_config(**{**dict(vocab_size=50, attn_type=attn_type, learned_positions=8), **changes})
    fused = txl.TransformerXL(config, compute)
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    reference = txl.TransformerXL(config, txl.ComputeConfig(attn_impl="reference"))
    reference.load_state_dict(fused.state_dict())
    return fused, reference


def assert_memories_equal(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_training_kernels_equal_the_reference(attn_type, context):
    """Train mode, dropout 0: loss, per-token NLL, memory and every parameter gradient, segment after segment
    (keys outnumber queries once the memory fills, and learned positions run out at K > 8)."""
    fused, reference = pair(attn_type, untie_r=attn_type == "relative", **CONTEXTS[context])
    assert_training_equal(fused, reference, torch.randint(0, 50, (2, 16)), TOL)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recompute"])
def test_shared_biases_reach_the_queries_through_the_projection(recompute):
    """The model's shared u and v (untie_r false, the paper's and NVIDIA's setting) as the fused path takes them:
    u as the q/k/v projection's bias, v - u added to its queries, both views of one tensor per layer, and the
    1/sqrt(D) scale in the kernels' matmuls: loss, memories and every gradient (u's and v's summed over the layers)
    equal the reference's, which adds u and v and scales term by term."""
    fused, reference = pair("relative", txl.ComputeConfig(recompute_attention=recompute), untie_r=False)
    assert fused.config.n_layer > 1 and fused.u.requires_grad
    assert_training_equal(fused, reference, torch.randint(0, 50, (2, 16)), TOL)


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_evaluation_kernels_equal_the_reference(attn_type, context):
    """Eval mode without autograd: log-probabilities and memories; with the key/value cache where it applies."""
    fused, reference = pair(attn_type, **CONTEXTS[context])
    fused.eval(), reference.eval()
    tokens = torch.randint(0, 50, (2, 16))
    mem_f = mem_r = None
    cache = fused.start_kv_cache()
    with torch.no_grad():
        for s in range(3):
            x = tokens[:, 5 * s:5 * s + 5]
            got = fused(x, memory=mem_f, kv_cache=cache)
            want = reference(x, memory=mem_r)
            torch.testing.assert_close(got.log_probs, want.log_probs, **TOL)
            assert_memories_equal(got.memory, want.memory)
            mem_f, mem_r, cache = got.memory, want.memory, got.kv_cache


@pytest.mark.parametrize("keep", ["recompute_attention=False", "dropatt"])
@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_explicit_kernel_and_dropatt_equal_the_reference(attn_type, keep):
    """The kernel that keeps the probabilities (by choice, or because dropatt drops them): with dropout and dropatt
    on, the same seed draws the same masks (nn.Dropout over the same number of elements, in the same order)."""
    # dropout_impl 'torch': nn.Dropout's draws, which the plain path (F.dropout) makes too
    changes = {} if keep != "dropatt" else dict(dropout=0.1, dropatt=0.2)
    fused, reference = pair(attn_type, txl.ComputeConfig(dropout_impl="torch"), **changes)
    tokens = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        memory = fused.eval()(tokens[:, :5]).memory
    x, y = tokens[:, 5:10], tokens[:, 6:11]
    grads = []
    for model in (fused.train(), reference.train()):
        torch.manual_seed(3)
        out = model(x, labels=y, memory=memory)
        out.loss.backward()
        grads.append((out.nll, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], **TOL)
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_attention_input_gradients_equal_the_reference(attn_type):
    """One attention layer: the gradients of its inputs (segment and memory rows) and of its parameters."""
    fused, reference = pair(attn_type, pre_ln=True)
    B, T, M, d = 2, 4, 3, 32
    K = M + T
    mask = attention_mask(T, M, mem_len=M, same_length=True, style="tensorflow")
    shared = {name: getattr(fused, name) for name in fused.encoding.shared_parameters(fused.config)}
    positions = fused.encoding.build_positions(fused.config, shared, K, 5, dtype=torch.float32, device=None,
                                               drop=torch.nn.Identity())[0]  # the first layer's
    u, v = getattr(fused, "u", None), getattr(fused, "v", None)
    x0, m0, weight = torch.randn(B, T, d), torch.randn(B, M, d), torch.randn(B, T, d)
    results = []
    for model in (fused.train(), reference.train()):
        attn = model.layers[0].attn
        x, memory = x0.clone().requires_grad_(), m0.clone().requires_grad_()
        (attn(x, memory, mask, positions, u, v) * weight).sum().backward()
        results.append([x.grad, memory.grad] + [p.grad for p in attn.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_bad_attn_impl_is_one_clear_line():
    with pytest.raises(ValueError, match=r"ComputeConfig.attn_impl='flash' is unknown; choose one of 'fused', "
                                         r"'reference'"):
        txl.ComputeConfig(attn_impl="flash")


# -- torch.compile --------------------------------------------------------------------------------

@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_forward_has_no_graph_break(attn_type, train, one_thread):
    """Input checks run outside the compiled graph (they read token values back: a host sync), and the custom
    autograd Functions give way to traceable ops: one graph, no break, in training and in evaluation."""
    model, _ = pair(attn_type, dropout=0.1)
    x, y = torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))
    memory = model.eval()(x).memory
    model.train(train)
    with torch.set_grad_enabled(train):
        explanation = torch._dynamo.explain(model)(x, labels=y, memory=memory)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.slow  # torch.compile (4-10 s loaded)
def test_compiled_loss_and_gradients_equal_eager(one_thread):
    """fp32, dropout 0: the compiled training step (aot_eager: the graphs autograd and the compiler make) gives the
    eager loss within 1e-5, and the same gradients."""
    model, _ = pair("relative", untie_r=True)
    x, y = torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))
    memory = model.eval()(x).memory
    model.train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for run in (compiled, model):
        model.zero_grad()
        loss = run(x, labels=y, memory=memory).loss
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert abs(results[0][0] - results[1][0]) <= 1e-5
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.skipif(os.environ.get("TXL_SLOW_TESTS") != "1", reason="inductor compiles take ~40 s on 2 cores; "
                                                                   "run with TXL_SLOW_TESTS=1")
def test_inductor_compiled_loss_equals_eager(one_thread):
    model, _ = pair("relative")
    x, y = torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))
    memory = model.eval()(x).memory
    model.train()
    compiled = torch.compile(model, fullgraph=True)
    assert abs(compiled(x, labels=y, memory=memory).loss.item() - model(x, labels=y, memory=memory).loss.item()) <= 1e-5


@pytest.mark.parametrize("recompute, kept", [(True, 0), (False, 1)])
@pytest.mark.parametrize("attn_type", ["relative", "shaw"])
def test_training_keeps_one_probability_tensor_per_layer_or_none(attn_type, recompute, kept):
    """What autograd holds from forward to backward: with recompute_attention no (.., T, K) score-sized tensor,
    without it exactly one per layer (the probabilities: neither the bias nor the scores are kept beside them)."""
    config = tiny_config(vocab_size=50, attn_type=attn_type, learned_positions=8)
    model = txl.TransformerXL(config, txl.ComputeConfig(recompute_attention=recompute)).train()
    tokens = torch.randint(0, 50, (2, 12))
    memory = model(tokens[:, :6]).memory
    B, T, K = 2, 6, 12
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens[:, 6:], labels=torch.roll(tokens[:, 6:], -1, 1), memory=memory)
    score_sized = {t.untyped_storage().data_ptr() for t in saved if t.numel() == B * config.n_head * T * K}
    assert len(score_sized) == kept * config.n_layer
    out.loss.backward()  # and the kept graph still runs
