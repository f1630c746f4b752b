"""The ``recall`` corpus: generated key-value recall with dependencies at known distances.

A controlled test of what segment-level recurrence carries (Dai et al. 2019, section 3.2: with
recurrence the longest dependency an N-layer model can use grows as O(N x L); without it, it stops at
the segment). The stream is words of three kinds::

    f7 f30 k12=v3 f1 f9 ... f22 k12 v3 f4 ...

* ``k=v`` defines key ``k`` (one of ``n_keys``) with value ``v`` (one of ``n_values``, uniform), as ONE
  word: a single attention layer can then answer (the query's key matches the definition's word and its
  value is read off that same word), with no previous-token head to form first. With key and value as
  two words the lookup needs an induction circuit across two layers, and the small models of
  ``experiments.longrange`` stayed on the associative-recall plateau for their whole budget (all at
  chance, even within the segment: the closing note of issue 25);
* ``k v``, ``distance`` tokens later (definition to answer), asks for it again: the ``v`` after a key
  word is an *answer*, predictable only by recalling the definition (keys appear nowhere else);
* ``f*`` filler words, uniform and independent of everything, so the filler carries no hint of any
  answer; the value of a definition is itself unpredictable.

Each definition draws its distance log-uniformly from ``[min_distance, max_distance]`` (every octave
gets the same share, from a few tokens to several times n_layer x mem_len of the small models that read
it); a query is written at the first free position once due, so the realised distance can exceed the
drawn one by a few tokens. A key is not redefined while its query is pending, so the latest
definition of a key is its answer. Chance is 1 / n_values for a model that knows an answer is a value.

The answers are marked by the structure itself: ``answers(tokens, tokenizer)`` returns the position of
every answer token and its distance, so loss and accuracy can be read on them alone.

The splits are generated from (seed, split) with numpy's PCG64: the same files on every machine. They
are written as ``train.txt``/``valid.txt``/``test.txt`` (lines of ``LINE_WORDS`` words, no end-of-line
token) into a cache entry keyed by the generator's parameters; ``REGISTRY["recall"]`` reads them at word
level like any other corpus.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from txl.data import cache

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RecallParams:
    """The generator's parameters (all enter the cache key)."""

    n_keys: int = 8
    """Distinct keys: few, so that each key=value word is seen often enough to be learned; they bound the
    definitions pending at once (usually all eight are)."""
    n_values: int = 16
    """Distinct values: chance accuracy on an answer is 1 / n_values, chance loss ln(n_values)."""
    n_filler: int = 32
    """Distinct filler words."""
    min_distance: int = 3
    """Shortest drawn distance, definition to answer (at least 2: the query's key comes between)."""
    max_distance: int = 512
    """Longest drawn distance (realised ones may exceed it by a few tokens)."""
    train_short_share: float = 0.7
    """In the train split only, the share of definitions whose distance is drawn log-uniformly from
    [min_distance, short_distance] instead: the short lookups form the matching attention quickly, which then
    serves the long ones (a curriculum mixed into the stream, since the iterator reads the split as parallel
    streams). Validation and test keep the plain log-uniform law."""
    short_distance: int = 24
    """Longest distance of the train split's short definitions."""
    define_rate: float = 0.3
    """Probability that a free position starts a definition, while a key is free (dense: many answers per
    token, so the lookup has signal to form on)."""
    tokens: tuple[int, int, int] = (2_000_000, 200_000, 200_000)
    """Words in train, valid and test."""
    seed: int = 0


SPLITS = ("train", "valid", "test")
LINE_WORDS = 32
"""Words per line of the written files (lines carry no token: the tokenizer adds no end-of-line)."""


def definition(key: int, value: int) -> str:
    """The one word that defines ``key`` as ``value``."""
    return f"k{key}=v{value}"


def generate(n_tokens: int, params: RecallParams, split: int) -> list[str]:
    """The words of one split: filler with definitions and their queries at log-uniform distances."""
    rng = np.random.Generator(np.random.PCG64([params.seed, split]))
    lo, hi = math.log(params.min_distance), math.log(params.max_distance)
    short_hi = math.log(params.short_distance)
    short_share = params.train_short_share if split == 0 else 0.0
    words: list[str] = []
    pending: list[tuple[int, int, int, int]] = []  # (due position of the query's value, order, key, value)
    free = list(range(params.n_keys))
    order = 0
    while len(words) < n_tokens:
        pos = len(words)
        if pending and pending[0][0] <= pos + 1:  # due: "k v" puts the answer at pos + 1
            _, _, key, value = heapq.heappop(pending)
            words += [f"k{key}", f"v{value}"]
            free.append(key)
        elif free and rng.random() < params.define_rate:
            key = free.pop(int(rng.integers(len(free))))
            value = int(rng.integers(params.n_values))
            short = short_share > 0 and rng.random() < short_share
            distance = int(round(math.exp(rng.uniform(lo, short_hi if short else hi))))
            words.append(definition(key, value))
            heapq.heappush(pending, (pos + distance, order, key, value))
            order += 1
        else:
            words.append(f"f{int(rng.integers(params.n_filler))}")
    return words[:n_tokens]


def answers(tokens: np.ndarray, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """(positions, distances) of every answer in ``tokens``: the value after a key word, and how many tokens
    after the latest definition of that key it stands. Queries whose definition is not in ``tokens`` (a cut
    stream) or whose value runs past the end are left out. int64 arrays, positions increasing."""
    words = {i: w for w, i in tokenizer.vocab.index.items()}
    keys = {i: w for i, w in words.items() if w.startswith("k") and "=" not in w}
    defines = {i: w.split("=")[0] for i, w in words.items() if "=" in w}
    toks = np.asarray(tokens, dtype=np.int64)
    is_key = np.isin(toks, np.fromiter(keys, dtype=np.int64, count=len(keys)))
    is_def = np.isin(toks, np.fromiter(defines, dtype=np.int64, count=len(defines)))
    latest: dict[str, int] = {}
    positions, distances = [], []
    for m in np.flatnonzero(is_key | is_def):
        if is_def[m]:
            latest[defines[int(toks[m])]] = int(m)
        elif m + 1 < len(toks) and keys[int(toks[m])] in latest:
            positions.append(m + 1)
            distances.append(m + 1 - latest.pop(keys[int(toks[m])]))
    return np.asarray(positions, dtype=np.int64), np.asarray(distances, dtype=np.int64)


def build_recall_corpus(cache_dir: Path, params: RecallParams | None = None) -> Path:
    """Write (or find) the three split files under ``cache_dir``; return the directory holding them."""
    params = RecallParams() if params is None else params
    key = cache.cache_key({"kind": "recall", "version": 2, **asdict(params)})
    entry = cache.lookup(cache_dir, key)
    if entry is not None:
        return entry

    def fill(tmp: Path) -> dict[str, Any]:
        for i, (split, n) in enumerate(zip(SPLITS, params.tokens)):
            words = generate(n, params, i)
            lines = (" ".join(words[s:s + LINE_WORDS]) + "\n" for s in range(0, len(words), LINE_WORDS))
            (tmp / f"{split}.txt").write_text("".join(lines), encoding="utf-8")
        return {"params": asdict(params)}

    entry = cache.build(cache_dir, key, fill)
    log.info("recall corpus (%s words) -> %s", ", ".join(f"{s} {n:,}" for s, n in zip(SPLITS, params.tokens)), entry)
    return entry
