"""txl.evaluate carries a key/value cache between segments: its loss equals the uncached pass's."""

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
from txl.data import IGNORE_INDEX, eval_iterator
from txl.evaluate import evaluate
from txl.model.attention import attn_types


def uncached_mean_nll(model, tokens, *, batch_size, tgt_len, ext_len):
    """The same walk over the streams as evaluate, written out without a KVCache."""
    total, count, memory = 0.0, 0, None
    with torch.no_grad():
        for batch in eval_iterator(tokens, batch_size=batch_size, tgt_len=tgt_len, ext_len=ext_len):
            out = model(batch.input_ids, labels=batch.labels, memory=memory)
            memory = out.memory
            total += float(out.nll.double().sum())
            count += int((batch.labels != IGNORE_INDEX).sum())
    return total / count, count


def perturbed(**changes) -> txl.TransformerXL:
    config = tiny_config(vocab_size=40, mem_len=9, learned_positions=64, **changes)
    model = txl.TransformerXL(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def caches_seen(model, monkeypatch) -> list:
    """Record the kv_cache argument of every forward call of ``model``."""
    seen, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: seen.append(kw.get("kv_cache")) or forward(*a, **kw))
    return seen


@pytest.mark.parametrize("changes", [dict(attn_type="relative"), dict(attn_type="relative", same_length=True),
                                     dict(attn_type="relative", ext_len=2, pre_ln=True, untie_r=True),
                                     dict(attn_type="shaw"), dict(attn_type="rotary")])
def test_evaluate_with_cached_keys_equals_recomputing_them(changes, monkeypatch):
    torch.manual_seed(0)
    model = perturbed(**changes)
    tokens = np.random.default_rng(0).integers(0, 40, 301)
    seen = caches_seen(model, monkeypatch)
    result = evaluate(model, tokens, metric="ppl", batch_size=3, tgt_len=7)
    assert all(c is not None for c in seen) and all(c.keys for c in seen[1:])  # the cache is carried, filled
    monkeypatch.undo()
    want, count = uncached_mean_nll(model, tokens, batch_size=3, tgt_len=7, ext_len=model.config.ext_len)
    assert result.tokens == count > 250
    assert result.loss == pytest.approx(want, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("attn_type", attn_types(cacheable=False))
def test_evaluate_without_a_cache_where_keys_shift(attn_type, monkeypatch):
    """Absolute encodings add to each memory row a position that shifts every segment: evaluate carries the
    memory alone (no cache) and reads the same loss as the walk written out."""
    model = perturbed(attn_type=attn_type)
    tokens = np.random.default_rng(0).integers(0, 40, 301)
    seen = caches_seen(model, monkeypatch)
    result = evaluate(model, tokens, metric="ppl", batch_size=3, tgt_len=7)
    assert seen and all(c is None for c in seen)
    monkeypatch.undo()
    want, count = uncached_mean_nll(model, tokens, batch_size=3, tgt_len=7, ext_len=0)
    assert result.tokens == count and result.loss == pytest.approx(want, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("max_batches", [0, 4])
def test_on_segment_reports_each_segment_of_the_total(max_batches):
    """The progress hook sees every segment once, counting up to a total it knows from the start."""
    model = txl.TransformerXL(tiny_config(vocab_size=40, mem_len=5)).eval()
    tokens = np.random.default_rng(0).integers(0, 40, 301)
    calls = []
    evaluate(model, tokens, metric="ppl", batch_size=3, tgt_len=7, max_batches=max_batches,
             on_segment=lambda done, total: calls.append((done, total)))
    n = len(eval_iterator(tokens, batch_size=3, tgt_len=7)) if not max_batches else max_batches
    assert calls == [(i, n) for i in range(1, n + 1)] and n > 3


def test_segment_progress_draws_a_bar_of_segments_only_when_enabled_and_on_a_terminal(capsys, monkeypatch):
    import txl.metrics
    from txl.metrics import segment_progress

    def draw():
        with segment_progress(True, "valid") as hook:
            for i in range(1, 4):
                hook(i, 3)
        return capsys.readouterr().err

    with segment_progress(False, "valid") as hook:
        assert hook is None
    assert draw() == ""  # stderr redirected (here: captured): no bar, no cursor escapes in the log
    monkeypatch.setattr(txl.metrics, "_is_terminal", lambda stream: True)
    err = draw()
    assert "valid:" in err and "/3 " in err and "segment" in err
