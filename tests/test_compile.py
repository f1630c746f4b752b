"""torch.compile of a word-level model: the adaptive softmax's tail clusters (cutoffs set, div_val 1 and 4) in one
graph, in training and in evaluation (key/value cache carried), and the compiled model equals the eager one.

The graph-break count comes from ``torch._dynamo.explain``; the numbers from the ``aot_eager`` backend (the graphs
dynamo and autograd make, run without inductor's code generation, which takes minutes on 2 cores: inductor
timings are in benchmarks/README.md, ``python -m benchmarks.compile``).
"""

import pytest
import torch
from conftest import tiny_config

import txl

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(atol=1e-5, rtol=1e-5)


def word_model(div_val: int, dropout: float = 0.0) -> txl.TransformerXL:
    """Three clusters (a shortlist of 20 and tails of 40 and 60 ids), weights perturbed so every bias counts."""
    model = txl.TransformerXL(tiny_config(vocab_size=120, cutoffs=[20, 60], div_val=div_val, dropout=dropout))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def zipf_tokens(shape: tuple[int, ...], vocab: int = 120) -> torch.Tensor:
    """Ids drawn as words fall (p ~ 1/rank), so every cluster gets some tokens and some tokens none."""
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(probs, shape[0] * shape[1], replacement=True).view(shape)


@pytest.mark.parametrize("div_val", [1, 4])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_adaptive_softmax_compiles_in_one_graph(div_val, train):
    model = word_model(div_val, dropout=0.1)
    x, y = zipf_tokens((2, 6)), zipf_tokens((2, 6))
    y[0, 0] = 119  # the last tail cluster is met
    memory = model.eval()(x).memory
    model.train(train)
    kwargs = dict(labels=y, memory=memory) if train else dict(labels=y, memory=memory, kv_cache=txl.KVCache())
    with torch.set_grad_enabled(train):
        explanation = torch._dynamo.explain(model)(x, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("div_val", [1, 4])
def test_compiled_training_equals_eager(div_val):
    """fp32, dropout 0: loss, per-token NLL and every gradient of the compiled step equal eager's within 1e-5."""
    model = word_model(div_val)
    x, y = zipf_tokens((3, 7)), zipf_tokens((3, 7))
    y[1, 2] = -100  # an ignored position
    y[0, :2] = torch.tensor([30, 119])  # both tail clusters are met
    memory = model.eval()(x).memory
    model.train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for run in (compiled, model):
        model.zero_grad()
        out = run(x, labels=y, memory=memory)
        out.loss.backward()
        results.append((out.loss.detach(), out.nll.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], **TOL)
    torch.testing.assert_close(results[0][1], results[1][1], **TOL)
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.slow  # torch.compile (8-10 s each loaded)
@pytest.mark.parametrize("div_val", [1, 4])
def test_compiled_evaluation_equals_eager(div_val):
    """Segments read with memory and the key/value cache carried, as txl.evaluate reads a split: from the same
    memory and cache, the compiled model's per-token NLL, log-probabilities and memory equal eager's within 1e-5.
    (Two eager segments first fill the memory and grow the cache's positional table, so the compiled segments
    all have one shape and compile once.)"""
    model = word_model(div_val).eval()
    tokens = zipf_tokens((2, 25))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        memory, cache = None, txl.KVCache()
        for s in range(4):
            x, y = tokens[:, 6 * s:6 * s + 6], tokens[:, 6 * s + 1:6 * s + 7]
            want = model(x, labels=y, memory=memory, kv_cache=cache, return_log_probs=True)
            if s >= 2:
                got = compiled(x, labels=y, memory=memory, kv_cache=cache, return_log_probs=True)
                torch.testing.assert_close(got.nll, want.nll, **TOL)
                torch.testing.assert_close(got.log_probs, want.log_probs, **TOL)
                for a, b in zip(got.memory + got.kv_cache.keys, want.memory + want.kv_cache.keys, strict=True):
                    torch.testing.assert_close(a, b, **TOL)
            memory, cache = want.memory, want.kv_cache
