"""The ordered segment iterator: layout, labels, carried context, resume, distributed, var-len."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from txl.data.iterator import IGNORE_INDEX, OrderedIterator, eval_iterator


def _collect(it):
    return [(b.input_ids.clone(), b.labels.clone(), b.context_len, b.start) for b in it]


def test_batches_match_hand_computation():
    tokens = np.arange(21, dtype=np.uint16)  # trimmed to 20: streams 0..9 and 10..19
    batches = list(OrderedIterator(tokens, batch_size=2, tgt_len=4))
    assert [b.start for b in batches] == [0, 4, 8]
    assert batches[0].input_ids.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert batches[0].labels.tolist() == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert batches[1].input_ids.tolist() == [[4, 5, 6, 7], [14, 15, 16, 17]]
    assert batches[2].input_ids.tolist() == [[8], [18]]  # the last segment is shorter
    assert batches[2].labels.tolist() == [[9], [19]]
    assert batches[0].input_ids.dtype == batches[0].labels.dtype == torch.int64


def test_labels_are_the_next_token_and_streams_continue():
    tokens = np.random.default_rng(0).integers(0, 50, size=203)
    streams = tokens[:200].reshape(4, 50)
    batches = list(OrderedIterator(tokens, batch_size=4, tgt_len=7))
    for b in batches:
        assert torch.equal(b.labels[:, :-1], b.input_ids[:, 1:])
    for prev, nxt in zip(batches, batches[1:], strict=False):
        assert torch.equal(prev.labels[:, -1], nxt.input_ids[:, 0])  # segments continue each stream
    joined = torch.cat([b.input_ids for b in batches], dim=1)
    assert joined.tolist() == streams[:, :-1].tolist()  # every input position once, in order


def test_ext_len_context_is_carried_and_ignored_by_the_loss():
    tokens = np.arange(20)
    batches = list(OrderedIterator(tokens, batch_size=2, tgt_len=4, ext_len=2))
    assert batches[0].context_len == 0 and batches[0].input_ids.shape == (2, 4)
    b = batches[1]
    assert b.context_len == 2 and b.tgt_len == 4
    assert b.input_ids.tolist() == [[2, 3, 4, 5, 6, 7], [12, 13, 14, 15, 16, 17]]
    assert b.labels.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7, 8],
                                 [IGNORE_INDEX, IGNORE_INDEX, 15, 16, 17, 18]]
    assert tokens.tolist() == list(range(20))  # the -100s never leak into the token array


def test_resume_mid_epoch_yields_the_same_batches():
    tokens = np.random.default_rng(1).integers(0, 100, size=2000)
    kwargs = dict(batch_size=4, tgt_len=12, ext_len=3, var_len=True, seed=7)
    reference = OrderedIterator(tokens, **kwargs)
    expected = _collect(reference) + _collect(reference)  # two epochs
    it = OrderedIterator(tokens, **kwargs)
    got, gen = [], iter(it)
    for _ in range(5):
        b = next(gen)
        got.append((b.input_ids, b.labels, b.context_len, b.start))
    state = json.loads(json.dumps(it.state_dict()))  # small and serialisable
    resumed = OrderedIterator(tokens, **kwargs)
    resumed.load_state_dict(state)
    got += _collect(resumed)
    assert resumed.epoch == 1
    got += _collect(resumed)
    assert len(got) == len(expected)
    for (a, la, ca, sa), (b, lb, cb, sb) in zip(got, expected, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb) and (ca, sa) == (cb, sb)


def test_resume_rejects_state_of_other_layout():
    it = OrderedIterator(np.arange(100), batch_size=4, tgt_len=5)
    with pytest.raises(ValueError, match="same data and global batch size"):
        OrderedIterator(np.arange(100), batch_size=5, tgt_len=5).load_state_dict(it.state_dict())


@pytest.mark.parametrize("var_len", [False, True])
def test_union_over_ranks_equals_single_process_batch(var_len):
    tokens = np.random.default_rng(2).integers(0, 100, size=1001)
    kwargs = dict(batch_size=6, tgt_len=9, ext_len=2, var_len=var_len, seed=3)
    single = _collect(OrderedIterator(tokens, **kwargs))
    ranks = [_collect(OrderedIterator(tokens, rank=r, world_size=3, **kwargs)) for r in range(3)]
    assert all(len(r) == len(single) for r in ranks)
    for k, (inputs, labels, _, _) in enumerate(single):
        assert torch.equal(torch.cat([r[k][0] for r in ranks]), inputs)
        assert torch.equal(torch.cat([r[k][1] for r in ranks]), labels)
        assert ranks[1][k][0].shape[0] == 2  # rank r holds streams [2r, 2r + 2)


def test_batch_size_must_divide_by_world_size():
    with pytest.raises(ValueError, match="divisible by world_size=4"):
        OrderedIterator(np.arange(100), batch_size=6, tgt_len=5, world_size=4, rank=0)
    with pytest.raises(ValueError, match="rank=2"):
        OrderedIterator(np.arange(100), batch_size=4, tgt_len=5, world_size=2, rank=2)
    with pytest.raises(ValueError, match="too few"):
        OrderedIterator(np.arange(3), batch_size=4, tgt_len=5)


def test_var_len_is_deterministic_per_seed_and_bounded():
    tokens = np.arange(40_000)

    def lengths(seed):
        return [b.tgt_len for b in OrderedIterator(tokens, batch_size=2, tgt_len=40, var_len=True, seed=seed)]

    a, b, c = lengths(0), lengths(0), lengths(1)
    assert a == b and a != c
    assert min(a[:-1]) >= 5 and max(a) <= 40 + 15
    assert len(set(a)) > 5  # jitter happens
    assert sum(x < 30 for x in a) > 0  # the occasional half-length segment
    assert sum(a) == 20_000 - 1  # together they cover every target exactly once


def test_eval_iterator_has_fixed_length():
    it = eval_iterator(np.arange(1000), batch_size=2, tgt_len=30)
    lengths = [b.tgt_len for b in it]
    assert lengths[:-1] == [30] * (len(lengths) - 1) and sum(lengths) == 499
    assert len(it) == len(lengths)


def test_works_on_a_memory_map(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.uint8))
    tokens = np.load(tmp_path / "t.npy", mmap_mode="r")
    b = next(iter(OrderedIterator(tokens, batch_size=2, tgt_len=3)))
    assert b.input_ids.tolist() == [[0, 1, 2], [50, 51, 52]] and b.input_ids.dtype == torch.int64
