"""The recall corpus (txl.data.recall): seeded and deterministic, answers marked with their true distances,
distances spanning short to long, and filler that tells nothing about the answers."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest

from txl.data import REGISTRY, corpora, load_corpus
from txl.data.recall import RecallParams, answers, build_recall_corpus, generate

SMALL = RecallParams(tokens=(60_000, 20_000, 5_000))


class Vocab:
    def __init__(self, words):
        self.index = {w: i for i, w in enumerate(sorted(set(words)))}
        self.vocab = self


def test_generation_is_seeded_and_splits_differ():
    a, b = generate(5000, SMALL, 0), generate(5000, SMALL, 0)
    assert a == b
    assert a != generate(5000, SMALL, 1) and a != generate(5000, RecallParams(seed=1), 0)


def test_answers_recall_the_latest_definition_at_the_stated_distance():
    words = generate(40_000, SMALL, 1)  # validation: the plain log-uniform law (train mixes in short ones)
    vocab = Vocab(words)
    tokens = np.array([vocab.index[w] for w in words])
    positions, distances = answers(tokens, vocab)
    assert len(positions) > 1000
    for p, d in zip(positions, distances):
        key, value = words[p - 1], words[p]
        assert key.startswith("k") and "=" not in key and value.startswith("v")
        assert words[p - d] == f"{key}={value}"  # the definition of the same key, with the answer as its value
        assert not any(w.startswith(f"{key}=") or w == key for w in words[p - d + 1:p - 1])  # nothing in between
    assert distances.min() <= 8 and distances.max() >= 384  # from within a segment to several times n_layer x mem
    counts = Counter(int(np.log2(d)) for d in distances)  # log-uniform: each octave from 4 to 256 alike
    assert max(counts[k] for k in range(2, 8)) < 1.6 * min(counts[k] for k in range(2, 8))


def test_filler_carries_no_hint_of_the_answer():
    """The word before each query, and the filler nearest to the answer, are independent of the answer: their
    empirical mutual information with it is at the level of a shuffled pairing."""
    words = generate(200_000, SMALL, 0)
    vocab = Vocab(words)
    positions, _ = answers(np.array([vocab.index[w] for w in words]), vocab)
    answer = [words[p] for p in positions]
    before = [words[p - 2] for p in positions]  # the word before the query's key

    def mutual_information(xs, ys):
        n = len(xs)
        pxy, px, py = Counter(zip(xs, ys)), Counter(xs), Counter(ys)
        return sum(c / n * np.log(c * n / (px[x] * py[y])) for (x, y), c in pxy.items())

    shuffled = list(np.random.default_rng(0).permutation(answer))
    assert mutual_information(before, answer) < 2 * mutual_information(before, shuffled) + 0.01
    assert set(Counter(answer)) == {f"v{i}" for i in range(SMALL.n_values)}


def test_registry_entry_builds_once_and_loads_at_word_level(tmp_path, monkeypatch):
    spec = REGISTRY["recall"]
    assert (spec.generated, spec.level, spec.metric) == ("recall", "word", "ppl")
    monkeypatch.setattr(corpora, "build_recall_corpus", functools.partial(build_recall_corpus, params=SMALL))
    corpus = load_corpus("recall", cache_dir=tmp_path / "tokens")
    p = SMALL
    # keys, values, filler and the key=value definitions seen in train; no <eos>
    seen = set(generate(p.tokens[0], p, 0))
    assert corpus.vocab_size == len(seen) <= p.n_keys * (1 + p.n_values) + p.n_values + p.n_filler
    assert (len(corpus.train), len(corpus.valid), len(corpus.test)) == p.tokens
    assert corpus.tokenizer.decode(corpus.valid[:200]).split() == generate(200, p, 1)
    positions, distances = answers(corpus.valid, corpus.tokenizer)
    assert len(positions) > 500 and (distances > 0).all()
    again = load_corpus("recall", cache_dir=tmp_path / "tokens")
    assert again.cached and np.array_equal(again.valid, corpus.valid)


def test_recall_cannot_be_downloaded():
    with pytest.raises(ValueError, match="written by txl itself"):
        corpora.download_corpus("recall")
