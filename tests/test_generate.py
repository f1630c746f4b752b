"""Generation: token-by-token log-probabilities with memory equal one full forward pass; sampling API."""

import pytest
import torch
from conftest import tiny_config

import txl
from txl.generation import FINISHED, IncrementalDecoder, generate_stream, inference_context
from txl.model.attention import attn_types

TOL = dict(atol=1e-5, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

CONFIGS = {
    "plain_softmax": dict(vocab_size=61),
    # Tied adaptive softmax: three clusters, each narrower by div_val, output weights and projections tied.
    "adaptive_div2_tied": dict(vocab_size=97, cutoffs=[20, 50], div_val=2, d_embed=32, tie_weight=True,
                               tie_projs=[True, True, True]),
    "adaptive_div1_projected": dict(vocab_size=97, cutoffs=[30], d_embed=16, tie_projs=[False, True]),
    "clamp_pre_ln_untie_r": dict(vocab_size=61, clamp_len=5, pre_ln=True, untie_r=True),
}


def tiny_model(**overrides) -> txl.TransformerXL:
    model = txl.TransformerXL(tiny_config(**{"n_layer": 3, "dropout": 0.1, **overrides}))
    with torch.no_grad():  # perturb every parameter so biases, norms and u, v all matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.train()  # generation must switch dropout off by itself


def full_log_probs(model, tokens, **changes):
    """(B, L, V): one forward pass over the whole text, no memory."""
    with inference_context(model, **changes) as context:
        return model(tokens, return_log_probs=True, context=context).log_probs


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("prompt_len,segment_len", [(1, 4), (13, 4), (13, 64)])
def test_incremental_equals_full_forward(name, prompt_len, segment_len):
    """Prompt read in segments into memory, then one position per token == a full pass over the text."""
    model = tiny_model(**CONFIGS[name])
    B, L = 2, 29
    tokens = torch.randint(0, model.config.vocab_size, (B, L))
    full = full_log_probs(model, tokens, mem_len=L, same_length=False)  # (B, L, V)

    decoder = IncrementalDecoder(model, mem_len=L, segment_len=segment_len)
    steps = [decoder.feed(tokens[:, :prompt_len])]  # (B, V) after the prompt
    for t in range(prompt_len, L):
        steps.append(decoder.feed(tokens[:, t:t + 1]))  # (B, 1) in: one position against the memory
    incremental = torch.stack(steps, dim=1)  # (B, L - prompt_len + 1, V)

    torch.testing.assert_close(incremental, full[:, prompt_len - 1:], **TOL)
    assert decoder.memory[0].shape == (B, L, model.config.d_model)
    assert model.training and model.config.mem_len == 6  # the caller's model is left as it was


def test_sliding_window_equals_banded_full_pass():
    """mem_len smaller than the text: each token sees the last mem_len positions and itself, which is a
    full pass with the same_length mask of mem_len + 1 keys."""
    model = tiny_model(**CONFIGS["adaptive_div2_tied"])
    B, L, window = 2, 25, 5
    tokens = torch.randint(0, model.config.vocab_size, (B, L))
    full = full_log_probs(model, tokens, mem_len=window + 1, same_length=True, same_length_style="pytorch")
    decoder = IncrementalDecoder(model, mem_len=window, segment_len=1)
    incremental = torch.stack([decoder.feed(tokens[:, t:t + 1]) for t in range(L)], dim=1)
    torch.testing.assert_close(incremental, full, **TOL)
    assert decoder.memory[0].size(1) == window


def greedy_by_recomputation(model, prompt, n):
    """The slow reference: re-run the whole context for every new token."""
    ids = prompt
    for _ in range(n):
        lp = full_log_probs(model, ids)[:, -1]  # (B, V)
        ids = torch.cat([ids, lp.argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.size(1):]


def test_greedy_generation_equals_recomputation():
    model = tiny_model(**CONFIGS["adaptive_div2_tied"])
    prompt = torch.randint(0, 97, (3, 9))
    out = txl.generate(model, prompt, max_new_tokens=12, temperature=0, segment_len=4)
    assert out.shape == (3, 12)
    torch.testing.assert_close(out, greedy_by_recomputation(model, prompt, 12), atol=0, rtol=0)


def test_sampling_is_reproducible_and_streams():
    model = tiny_model(**CONFIGS["plain_softmax"])
    prompt = [5, 6, 7]
    kwargs = dict(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.95)
    a = txl.generate(model, prompt, seed=3, **kwargs)
    b = txl.generate(model, prompt, generator=torch.Generator().manual_seed(3), **kwargs)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    seen = []
    c = txl.generate(model, prompt, seed=3, on_token=seen.append, **kwargs)
    streamed = torch.stack(list(generate_stream(model, prompt, seed=3, **kwargs)), dim=1)
    torch.testing.assert_close(torch.stack(seen, dim=1), a, atol=0, rtol=0)
    torch.testing.assert_close(c, a, atol=0, rtol=0)
    torch.testing.assert_close(streamed, a, atol=0, rtol=0)
    assert a.shape == (1, 10)
    assert txl.generate(model, prompt, max_new_tokens=0).shape == (1, 0)


def test_each_token_is_one_position(monkeypatch):
    """After the prompt, the model only ever sees (B, 1) inputs: the context is never re-run."""
    model = tiny_model(**CONFIGS["plain_softmax"])
    shapes = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, **kw: shapes.append(tuple(ids.shape)) or forward(ids, **kw))
    txl.generate(model, torch.randint(0, 61, (2, 10)), max_new_tokens=5, segment_len=4, seed=0)
    assert shapes == [(2, 4), (2, 4), (2, 2)] + [(2, 1)] * 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(mem_len=0), "mem_len"),
    (dict(segment_len=0), "segment_len"),
    (dict(seed=1, generator=torch.Generator()), "seed or generator"),
])
def test_bad_sampling_parameters(kwargs, match):
    model = tiny_model(**CONFIGS["plain_softmax"])
    args = dict(max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=match):
        generate_stream(model, [1, 2], **args)  # raised at the call, before any token is asked for


@pytest.mark.parametrize("prompt,match", [
    ([], "empty"),
    (torch.zeros(1, 0, dtype=torch.long), "empty"),
    ([1, 99], "out of range"),
    ([[1, 2], []], "one of the prompts is empty"),
])
def test_bad_prompts(prompt, match):
    model = tiny_model(**CONFIGS["plain_softmax"])
    with pytest.raises(ValueError, match=match):
        txl.generate(model, prompt, max_new_tokens=2)


# -- key/value cache ---------------------------------------------------------------------------------

KV_CONFIGS = {
    "adaptive_div2_tied": CONFIGS["adaptive_div2_tied"],
    "clamp_pre_ln_untie_r": CONFIGS["clamp_pre_ln_untie_r"],
    "shaw": dict(vocab_size=61, attn_type="shaw", learned_positions=7),
    "rotary": dict(vocab_size=61, attn_type="rotary"),
    "ext_len": dict(vocab_size=61, ext_len=1),
}


@pytest.mark.parametrize("name", list(KV_CONFIGS))
def test_kv_cache_equals_uncached_forward(name):
    """Segments, then (B, 1) steps, past mem_len: cached keys give the uncached log-probs and memory."""
    model = tiny_model(**KV_CONFIGS[name]).eval()
    B, mem_len = 2, model.config.mem_len
    tokens = torch.randint(0, model.config.vocab_size, (B, 20))
    lengths = [4, 3] + [1] * 7 + [5] if name != "ext_len" else [4, 3, 2, 2, 5, 2, 2]  # ext_len needs T > 1
    memory, cache, start = None, txl.KVCache(), 0
    with torch.no_grad():
        for T in lengths:
            ids = tokens[:, start:start + T]
            start += T
            ref = model(ids, memory=memory)
            out = model(ids, memory=memory, kv_cache=cache)
            torch.testing.assert_close(out.log_probs, ref.log_probs, **TOL)
            for m, r in zip(out.memory, ref.memory):
                torch.testing.assert_close(m, r, **TOL)
            assert out.kv_cache.length == ref.memory[0].size(1) <= mem_len  # aligned with the memory
            memory, cache = ref.memory, out.kv_cache
    if model.config.attn_type == "relative" and model.config.clamp_len > 0:
        assert cache.positions[0].size(0) == model.config.clamp_len + 1  # clamped distances share a row


def test_kv_cache_built_from_memory_and_projects_one_position_per_step(monkeypatch):
    """KVCache() next to a memory is filled from it; afterwards a step projects W_kR R only for new distances."""
    model = tiny_model(**CONFIGS["adaptive_div2_tied"]).eval()
    tokens = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        ref = [model(tokens[:, :8])]
        for t in range(8, 16):
            ref.append(model(tokens[:, t:t + 1], memory=ref[-1].memory))  # (B, 1) steps without a cache
    rows = []
    attn = model.layers[0].attn
    monkeypatch.setattr(attn, "project_positions",
                        lambda pos, f=attn.project_positions: rows.append(pos.size(0)) or f(pos))
    with torch.no_grad():
        out = model(tokens[:, 8:9], memory=ref[0].memory, kv_cache=txl.KVCache())
        assert out.kv_cache.length == out.memory[0].size(1) == 6
        for t in range(9, 16):
            out = model(tokens[:, t:t + 1], memory=out.memory, kv_cache=out.kv_cache)
            torch.testing.assert_close(out.log_probs, ref[t - 7].log_probs, **TOL)
    assert rows == [7]  # K = 7 throughout: distances 0..6 are projected once, not K rows per step


def test_generation_uses_the_kv_cache():
    model = tiny_model(**CONFIGS["clamp_pre_ln_untie_r"])
    decoder = IncrementalDecoder(model, mem_len=8, segment_len=4)
    tokens = torch.randint(0, 61, (2, 12))
    decoder.feed(tokens[:, :6])
    for t in range(6, 12):
        decoder.feed(tokens[:, t:t + 1])
    assert decoder.kv_cache.length == decoder.memory[0].size(1) == 8
    assert decoder.kv_cache.keys[0].shape == (2, 8, 4, 8)  # (B, M, H, D)


def test_kv_cache_rejected_where_it_would_be_wrong():
    model = tiny_model(**CONFIGS["plain_softmax"])
    ids = torch.randint(0, 61, (2, 3))
    with pytest.raises(ValueError, match="eval mode"):
        model(ids, kv_cache=txl.KVCache())  # training mode
    model.eval()
    with pytest.raises(ValueError, match="no_grad"):
        model(ids, kv_cache=txl.KVCache())  # autograd on
    with torch.no_grad():
        first = model(ids, kv_cache=txl.KVCache())
        second = model(ids, memory=first.memory, kv_cache=first.kv_cache)
        with pytest.raises(ValueError, match="kv_cache holds 3 rows"):
            model(ids, memory=second.memory, kv_cache=first.kv_cache)  # wrong length for this memory
        with pytest.raises(ValueError, match="KVCache"):
            model(ids, memory=first.memory, kv_cache=first.kv_cache.keys)
        model.layers[0].attn.qkv.weight.add_(0.1)
        with pytest.raises(ValueError, match="other weights"):
            model(ids, memory=first.memory, kv_cache=first.kv_cache)
    for attn_type in attn_types(cacheable=False):
        other = tiny_model(vocab_size=61, attn_type=attn_type).eval()
        with torch.no_grad(), pytest.raises(ValueError, match=f"attn_type='{attn_type}'"):
            other(ids, kv_cache=txl.KVCache())
        with torch.no_grad():  # generation falls back to the memory alone
            assert txl.generate(other, ids, max_new_tokens=3, seed=0).shape == (2, 3)


# -- ragged batches, stopping, repetition penalty ----------------------------------------------------------

@pytest.mark.parametrize("attn_type", attn_types(relative=True))
@pytest.mark.parametrize("segment_len", [2, 64])
def test_left_padded_batch_equals_one_prompt_at_a_time(attn_type, segment_len):
    """Prompts of lengths 7, 2 and 4 read as one left-padded batch: every step's log-probabilities equal
    those of each prompt read alone (pad keys masked in memory and segment, keys cached)."""
    model = tiny_model(**CONFIGS["adaptive_div2_tied"], attn_type=attn_type)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (7, 2, 4)]
    steps = torch.randint(0, 97, (3, 5))  # (B, 5) tokens fed one at a time after the prompts
    batch, padding = torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.bool)
    for b, p in enumerate(prompts):
        batch[b, 7 - len(p):] = torch.tensor(p)
        padding[b, :7 - len(p)] = True
    decoder = IncrementalDecoder(model, mem_len=12, segment_len=segment_len)
    together = [decoder.feed(batch, padding)] + [decoder.feed(steps[:, t:t + 1]) for t in range(5)]
    for b, p in enumerate(prompts):
        alone = IncrementalDecoder(model, mem_len=12, segment_len=segment_len)
        expected = [alone.feed(torch.tensor([p]))] + [alone.feed(steps[b:b + 1, t:t + 1]) for t in range(5)]
        for got, want in zip(together, expected):
            torch.testing.assert_close(got[b:b + 1], want, **TOL)
    # The API pads lists of different lengths itself: greedy tokens equal one prompt at a time.
    new = txl.generate(model, prompts, max_new_tokens=6, temperature=0)
    for b, p in enumerate(prompts):
        assert new[b].tolist() == txl.generate(model, p, max_new_tokens=6, temperature=0)[0].tolist()
    # Sampling with a seed too: row b draws from its own generator (seed + b), so it equals its prompt alone.
    kwargs = dict(max_new_tokens=8, temperature=1.5, top_k=0, top_p=1.0)
    new = txl.generate(model, prompts, seed=11, **kwargs)
    for b, p in enumerate(prompts):
        assert new[b].tolist() == txl.generate(model, p, seed=11 + b, **kwargs)[0].tolist()
    again = txl.generate(model, [prompts[0]] * 3, seed=11, **kwargs)  # one prompt three times: three samples
    assert again[0].tolist() == new[0].tolist() and len({tuple(r) for r in again.tolist()}) > 1


def test_padding_needs_relative_positions():
    model = tiny_model(**CONFIGS["plain_softmax"], attn_type="absolute")
    with pytest.raises(ValueError, match="prompts of different lengths need relative positions"):
        txl.generate(model, [[1, 2, 3], [4]], max_new_tokens=2)


def test_stop_tokens_end_each_row_and_the_stream():
    model = tiny_model(**CONFIGS["plain_softmax"])
    prompts = [[1, 2, 3], [4, 5, 6]]
    free = txl.generate(model, prompts, max_new_tokens=8, temperature=0)  # (2, 8), no stop
    stop = int(free[0, 2])  # row 0 stops at its third token
    out = txl.generate(model, prompts, max_new_tokens=8, temperature=0, stop_tokens=[stop])
    first = [i for i, t in enumerate(free[1].tolist()) if t == stop]
    end1 = first[0] + 1 if first else 8
    k0 = free[0].tolist().index(stop) + 1
    assert out.shape == (2, max(k0, end1))  # the stream ends when both rows have stopped
    assert out[0, :k0].tolist() == free[0, :k0].tolist() and set(out[0, k0:].tolist()) <= {FINISHED}
    assert out[1, :end1].tolist() == free[1, :end1].tolist()


def test_stop_strings_read_the_decoded_text():
    model = tiny_model(**CONFIGS["plain_softmax"])
    free = txl.generate(model, [1, 2, 3], max_new_tokens=8, temperature=0)[0].tolist()
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    cut = decode(free[:3])[-4:]  # the text ends with the third token's last characters
    out = txl.generate(model, [1, 2, 3], max_new_tokens=8, temperature=0, stop_strings=[cut], decode=decode)[0]
    k = next(n for n in range(1, 9) if cut in decode(free[:n]))
    assert out.tolist() == free[:k]
    with pytest.raises(ValueError, match="stop_strings need decode="):
        txl.generate(model, [1], max_new_tokens=2, stop_strings=["x"])


def test_repetition_penalty_math_and_effect():
    from txl.sampling import apply_repetition_penalty

    lp = torch.tensor([[-0.5, -1.0, -2.0, 0.0]])
    seen = torch.tensor([[True, False, True, True]])
    out = apply_repetition_penalty(lp, seen, 2.0)
    assert out.tolist() == [[-1.0, -1.0, -4.0, 0.0]]  # seen scores doubled (p -> p**2), unseen unchanged
    assert torch.equal(apply_repetition_penalty(lp, seen, 1.0), lp)
    with pytest.raises(ValueError, match="repetition_penalty=0 must be > 0"):
        apply_repetition_penalty(lp, seen, 0)
    # A huge penalty makes greedy decoding avoid every token it has read or written.
    model = tiny_model(**CONFIGS["plain_softmax"])
    prompt = [1, 2, 3, 4]
    out = txl.generate(model, prompt, max_new_tokens=20, temperature=0, repetition_penalty=1e6)[0].tolist()
    assert len(set(prompt + out)) == len(prompt) + len(out)


def test_generate_is_the_function_and_generation_the_module():
    # The function and the module have different names, so importing the module never rebinds txl.generate.
    import importlib

    module = importlib.import_module("txl.generation")
    assert txl.generate is module.generate and callable(txl.generate)
    assert txl.generation.FINISHED == FINISHED == -1  # the README's name for a finished row's places
    assert txl.generate_stream is module.generate_stream
