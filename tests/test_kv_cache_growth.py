"""The memory and the cached keys/values grown in place (``RowBuffer``): the same numbers as copying them whole,
and every memory handed out keeps its values, whichever earlier state a caller goes back to."""

import pytest
import torch
from conftest import tiny_config

import txl
from txl.model.memory import RowBuffer, append_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def test_rows_are_appended_in_place_and_views_keep_their_values():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(2, n, 3, generator=g) for n in (4, 1, 1, 5, 1)]
    a, buffer = append_rows(None, rows[0], None, headroom=2)  # room for 2 more rows
    b, same = append_rows(a, rows[1], buffer, headroom=2)
    assert same is buffer and b.data_ptr() == a.data_ptr()  # extended in place: no copy of a's rows
    c, _ = append_rows(b, rows[2], buffer, headroom=2)
    # Going back to b (c was made from it): b's window no longer ends the buffer, so it is copied, not overwritten.
    c2, other = append_rows(b, rows[3], buffer, headroom=2)
    assert other is not buffer
    torch.testing.assert_close(c, torch.cat(rows[:3], 1), rtol=0, atol=0)
    torch.testing.assert_close(c2, torch.cat(rows[:2] + [rows[3]], 1), rtol=0, atol=0)
    # Past its capacity a buffer is replaced; the views of the old one keep their rows.
    d, newer = append_rows(c2, rows[4], other, headroom=2)
    assert newer is other  # room for 2 rows after c2's 10: extended in place
    e, newest = append_rows(d, rows[3], newer, headroom=2)
    assert newest is not newer  # 5 rows more than the 11 it holds (capacity 12): replaced
    torch.testing.assert_close(e, torch.cat(rows[:2] + rows[3:] + rows[3:4], 1), rtol=0, atol=0)
    torch.testing.assert_close(d, torch.cat(rows[:2] + rows[3:], 1), rtol=0, atol=0)
    torch.testing.assert_close(a, rows[0], rtol=0, atol=0)
    assert isinstance(newer, RowBuffer) and not newer.ends(c2) and newest.ends(e)


@pytest.mark.parametrize("mem_len", [1000, 7])
def test_cached_steps_grow_in_place_and_equal_uncached_ones(mem_len):
    """95 (B, 1) steps with a KVCache, memory growing (mem_len 1000) or sliding past mem_len 7: log-probs and memory
    equal those of steps without a cache (torch.cat), the memory of every step unchanged by the later ones, and a
    step taken again from an earlier state equal to the first time."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(vocab_size=50)).eval()
    ctx = model.config.context(mem_len=mem_len, same_length=False)
    ids = torch.randint(0, 50, (3, 100))
    with torch.no_grad():
        cached = model(ids[:, :5], memory=None, kv_cache=txl.KVCache(), context=ctx, return_log_probs=True)
        plain = model(ids[:, :5], memory=None, context=ctx, return_log_probs=True)
        states, kept = [cached], [tuple(m.clone() for m in cached.memory)]
        for t in range(5, 100):  # past the first buffer's 64 spare rows
            x = ids[:, t:t + 1]  # (B, 1)
            cached = model(x, memory=cached.memory, kv_cache=cached.kv_cache, context=ctx, return_log_probs=True)
            plain = model(x, memory=plain.memory, context=ctx, return_log_probs=True)
            torch.testing.assert_close(cached.log_probs, plain.log_probs, atol=1e-5, rtol=1e-5)
            for a, b in zip(cached.memory, plain.memory, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            states.append(cached)
            kept.append(tuple(m.clone() for m in cached.memory))
        assert cached.kv_cache.buffers and cached.memory[0].data_ptr() != kept[-1][0].data_ptr()
        for state, memory in zip(states, kept, strict=True):  # nothing handed out was overwritten
            for a, b in zip(state.memory, memory, strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        for k in (10, 90):  # a caller going back (to a full buffer, to one with room): the next step again, twice
            back = states[k]
            for _ in range(2):
                again = model(ids[:, 5 + k:6 + k], memory=back.memory, kv_cache=back.kv_cache, context=ctx,
                              return_log_probs=True)  # states[k + 1] read ids[:, 5 + k]
                torch.testing.assert_close(again.log_probs, states[k + 1].log_probs, atol=1e-6, rtol=1e-6)
