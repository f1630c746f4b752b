"""Scoring: batched, ragged documents score exactly as one at a time, and as one full forward pass."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
from txl.generation import inference_context
from txl.score import DocumentScore, ScoredSegment, iter_scores, score_documents

TOL = dict(atol=1e-5, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def tiny_model(**overrides):
    model = txl.TransformerXL(tiny_config(**{"vocab_size": 97, "cutoffs": [20, 50], "div_val": 2, "mem_len": 10,
                                             "dropout": 0.1, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def documents(lengths):
    return [np.random.default_rng(n).integers(0, 97, n) for n in lengths]


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("context_id", [None, 0])
def test_batched_equals_one_at_a_time(same_length, context_id):
    """Ragged lengths, memory shorter than the documents (truncation), segments not dividing lengths."""
    model = tiny_model()
    docs = documents([40, 1, 17, 0, 7, 23])
    kw = dict(segment_len=7, mem_len=10, same_length=same_length, context_id=context_id, keep_logprobs=True)
    batched = score_documents(model, docs, batch_size=4, **kw)
    alone = [score_documents(model, [d], batch_size=1, **kw)[0] for d in docs]
    for b, a, d in zip(batched, alone, docs):
        expected = len(d) - (context_id is None) if len(d) else 0
        assert b.n_tokens == a.n_tokens == expected
        np.testing.assert_allclose(b.logprobs, a.logprobs, **TOL)
        assert math.isclose(b.nll, a.nll, rel_tol=1e-6, abs_tol=1e-6)
    assert [r.doc for r in batched] == list(range(len(docs)))


def test_scores_equal_full_forward_when_memory_covers():
    model = tiny_model()
    doc = torch.randint(0, 97, (30,))
    [result] = score_documents(model, [doc], segment_len=4, mem_len=30, keep_logprobs=True)
    with inference_context(model, mem_len=30, same_length=False) as context:
        lp = model(doc[None, :-1], return_log_probs=True, context=context).log_probs[0]  # (29, V)
    expected = lp.gather(1, doc[1:, None]).squeeze(1).double().numpy()
    np.testing.assert_allclose(result.logprobs, expected, **TOL)
    assert math.isclose(result.perplexity, math.exp(-expected.mean()), rel_tol=1e-5)
    assert math.isclose(result.bits_per_token, -expected.mean() / math.log(2), rel_tol=1e-5)
    assert model.training  # left as it was


@pytest.mark.parametrize("doc, context_id", [([], None), ([5], None), ([], 0)])
def test_a_document_with_nothing_scored_has_no_figures_not_nan(doc, context_id):
    """An empty document (or one token without a context token) scores nothing: its totals are 0 and its mean
    figures None (as `txl score` writes null), never NaN; the documents around it score as alone."""
    model = tiny_model()
    other = documents([9])[0]
    empty, full = score_documents(model, [doc, other], segment_len=4, context_id=context_id)
    assert (empty.n_tokens, empty.nll) == (0, 0.0)
    assert empty.mean_nll is None and empty.perplexity is None and empty.bits_per_token is None
    [alone] = score_documents(model, [other], segment_len=4, context_id=context_id)
    assert full.perplexity == pytest.approx(alone.perplexity, rel=1e-6) and math.isfinite(full.perplexity)


def test_streams_segments_and_reads_iterators():
    """An iterator document (never held whole) gives the same scores, streamed segment by segment."""
    model = tiny_model()
    doc = documents([25])[0]
    items = list(iter_scores(model, [iter(doc.tolist())], segment_len=8, keep_logprobs=True))
    segments = [i for i in items if isinstance(i, ScoredSegment)]
    [total] = [i for i in items if isinstance(i, DocumentScore)]
    assert [s.start for s in segments] == [1, 9, 17]
    np.testing.assert_array_equal(np.concatenate([s.token_ids for s in segments]), doc[1:])
    [ref] = score_documents(model, [doc], segment_len=8, keep_logprobs=True)
    np.testing.assert_allclose(total.logprobs, ref.logprobs, **TOL)
    assert isinstance(items[-1], DocumentScore)


@pytest.mark.parametrize("kwargs,match", [
    (dict(segment_len=0), "segment_len"),
    (dict(batch_size=0), "batch_size"),
    (dict(mem_len=-1), "mem_len"),
    (dict(context_id=97), "context_id"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        iter_scores(tiny_model(), documents([5]), **kwargs)  # raised at the call


@pytest.mark.parametrize("same_length", [False, True])
def test_scoring_over_rings_equals_scoring_without(monkeypatch, same_length):
    """``graphs=True`` (``txl score --eval.graphs true``): every segment of every group through the key/value rings of
    ``txl.static_eval``, compiled once (the counting backend), the last group's rows and each group's last segment
    padded to that one shape: the same per-token log-probabilities and totals as the plain path."""
    from conftest import Counting

    from txl import static_eval

    counter = Counting()
    monkeypatch.setattr(static_eval, "compile_segment", lambda backend=None: torch.compile(
        static_eval.ring_segment, backend=counter, dynamic=False))
    torch._dynamo.reset()
    model = tiny_model()
    docs = documents([40, 1, 17, 0, 7, 23, 12])  # groups of 3, 3 and 1 documents
    kw = dict(segment_len=7, mem_len=10, same_length=same_length, context_id=0, keep_logprobs=True, batch_size=3)
    plain = score_documents(model, docs, **kw)
    with torch._dynamo.config.patch(error_on_recompile=True):
        rings = score_documents(model, docs, graphs=True, **kw)
    assert counter.graphs == 1 and counter.runs == 11  # 6, 3 and 2 segments: one graph for all
    for r, p in zip(rings, plain, strict=True):
        assert r.n_tokens == p.n_tokens
        np.testing.assert_allclose(r.logprobs, p.logprobs, **TOL)
        assert math.isclose(r.nll, p.nll, rel_tol=1e-6, abs_tol=1e-6)
