"""The plain path (txl.model.plain, attn_impl='reference') as the whole-model oracle.

It runs no custom autograd Function in a training step (counted), loads and runs Hugging Face's recorded
checkpoint, and the default path equals it: forward, gradients, new memory, the key/value cache (the default's
cached decoding against the plain path without one), the compressed memory and its loss, padding.
"""

from pathlib import Path

import pytest
import torch
from conftest import ATTN_TYPES, assert_training_equal, tiny_config

import txl
from txl.model import KVCache

TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
GOLDEN = Path(__file__).resolve().parent / "golden" / "hf_transfo_xl_tiny"


def pair(**changes) -> tuple[txl.TransformerXL, txl.TransformerXL]:
    """The default model and a plain one with the same (perturbed: every bias matters) weights."""
    config = tiny_config(**{**dict(vocab_size=50, learned_positions=8, cutoffs=[10, 30]), **changes})
    torch.manual_seed(0)
    fast = txl.TransformerXL(config)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    plain = txl.TransformerXL(config, txl.ComputeConfig(attn_impl="reference"))
    plain.load_state_dict(fast.state_dict())
    return fast, plain


@pytest.fixture
def function_calls(monkeypatch):
    """A list that records the class of every custom autograd Function applied while the test runs."""
    calls = []
    apply = torch.autograd.Function.apply.__func__

    def counting(cls, *args, **kwargs):
        calls.append(cls.__name__)
        return apply(cls, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counting))
    return calls


@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_a_plain_training_step_runs_no_custom_function(attn_type, function_calls):
    """Forward, loss, backward of two segments (memory carried), dropout on: zero custom Functions on the plain
    path; the default path, counted the same way, runs some (the count sees them)."""
    fast, plain = pair(attn_type=attn_type, dropout=0.1, dropatt=0.1)
    tokens = torch.randint(0, 50, (2, 11))
    counts = []
    for model in (plain.train(), fast.train()):
        function_calls.clear()
        memory = None
        for s in range(2):
            out = model(tokens[:, 5 * s:5 * s + 5], labels=tokens[:, 5 * s + 1:5 * s + 6], memory=memory)
            out.loss.backward()
            memory = out.memory
        counts.append(len(function_calls))
    assert counts[0] == 0
    assert counts[1] > 0


@pytest.mark.parametrize("changes", [dict(), dict(pre_ln=True), dict(untie_r=True), dict(same_length=True),
                                     dict(clamp_len=3), dict(div_val=2, d_embed=16, tie_projs=[False, True, True]),
                                     dict(cutoffs=[], tie_projs=[False]), dict(d_embed=16)],
                         ids=["base", "pre_ln", "untie_r", "same_length", "clamp_len", "div_val", "no_cutoffs",
                              "projected"])
def test_the_default_path_equals_the_plain_one_in_training(changes):
    """NLL, memory and every parameter gradient over three segments, memory carried."""
    fast, plain = pair(**changes)
    assert_training_equal(fast, plain, torch.randint(0, 50, (2, 16)), GRAD_TOL)


@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_log_probs_and_memory_equal_over_segments(attn_type):
    fast, plain = pair(attn_type=attn_type)
    tokens = torch.randint(0, 50, (3, 12))
    memories = [None, None]
    with torch.no_grad():
        for s in range(3):
            outs = [m.eval()(tokens[:, 4 * s:4 * s + 4], memory=memories[i]) for i, m in enumerate((fast, plain))]
            torch.testing.assert_close(outs[0].log_probs, outs[1].log_probs, **TOL)
            torch.testing.assert_close(outs[0].log_probs.exp().sum(-1), torch.ones(3, 4), **TOL)
            memories = [o.memory for o in outs]
            for a, b in zip(*memories, strict=True):
                torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("attn_type", ["relative", "shaw", "rotary"])
def test_cached_decoding_equals_the_plain_path_without_a_cache(attn_type):
    """The default path decoding token by token with a KVCache gives the plain path's log-probabilities, which
    recomputes every key; the plain path's own returned cache holds the new memory's keys."""
    fast, plain = pair(attn_type=attn_type, mem_len=8)
    fast.eval(), plain.eval()
    tokens = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        a = fast(tokens[:, :4], kv_cache=KVCache())
        b = plain(tokens[:, :4], kv_cache=KVCache())
        for t in range(4, 10):
            a = fast(tokens[:, t:t + 1], memory=a.memory, kv_cache=a.kv_cache)
            b = plain(tokens[:, t:t + 1], memory=b.memory, kv_cache=b.kv_cache)
            torch.testing.assert_close(a.log_probs, b.log_probs, **TOL)
            assert b.kv_cache.length == a.kv_cache.length == b.memory[0].size(1)
            for k_a, k_b in zip(a.kv_cache.keys, b.kv_cache.keys, strict=True):
                torch.testing.assert_close(k_a, k_b, **TOL)


def test_compressed_memory_and_its_loss_equal_the_plain_path():
    """A compressive model ('conv', learnt): state, reconstruction loss and every gradient over segments that
    compress."""
    fast, plain = pair(mem_len=4, cmem_len=3, cmem_rate=2)
    tokens = torch.randint(0, 50, (2, 17))
    states = [None, None]
    for s in range(4):
        x, y = tokens[:, 4 * s:4 * s + 4], tokens[:, 4 * s + 1:4 * s + 5]
        outs = []
        for i, model in enumerate((fast.train(), plain.train())):
            model.zero_grad()
            out = model(x, labels=y, memory=states[i])
            (out.loss + (out.compression_loss if out.compression_loss is not None else 0)).backward()
            states[i] = out.memory
            outs.append(out)
        torch.testing.assert_close(outs[0].nll, outs[1].nll, **TOL)
        if outs[0].compression_loss is not None:
            torch.testing.assert_close(outs[0].compression_loss, outs[1].compression_loss, **TOL)
        for a, b in zip(*states, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        for (name, p), q in zip(fast.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=name)
    assert any(cm.size(1) for cm in states[0][fast.config.n_layer:])  # something was compressed


def test_padding_equals_the_plain_path():
    """Left-padded rows of different lengths: the default path's outputs at real positions are the plain path's."""
    fast, plain = pair()
    tokens = torch.randint(0, 50, (2, 6))
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, :2] = True
    with torch.no_grad():
        a, b = (m.eval()(tokens, padding=padding) for m in (fast, plain))
    torch.testing.assert_close(a.log_probs[0, 2:], b.log_probs[0, 2:], **TOL)
    torch.testing.assert_close(a.log_probs[1], b.log_probs[1], **TOL)


def test_the_recorded_hugging_face_checkpoint_runs_the_same_on_both_paths():
    """Hugging Face's own tiny checkpoint (recorded by transformers 4.37.2, tests/golden) loads under both plans;
    they agree on its log-probabilities and memory (the oracle itself: tests/test_parity_hf.py, both paths)."""
    pytest.importorskip("safetensors")
    from txl.pretrained import from_pretrained

    fast = from_pretrained(GOLDEN)
    plain = from_pretrained(GOLDEN, compute=txl.ComputeConfig(attn_impl="reference"))
    assert (fast.plan.attn_impl, plain.plan.attn_impl, plain.config) == ("fused", "reference", fast.config)
    tokens = torch.randint(0, fast.config.vocab_size, (2, 9))
    with torch.no_grad():
        a, b = fast(tokens), plain(tokens)
        torch.testing.assert_close(a.log_probs, b.log_probs, **TOL)
        for m_a, m_b in zip(a.memory, b.memory, strict=True):
            torch.testing.assert_close(m_a, m_b, **TOL)
