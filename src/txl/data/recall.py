"""The ``recall`` corpus: generated key-value recall with dependencies at known distances.

A controlled test of what segment-level recurrence carries (Dai et al. 2019, section 3.2: with
recurrence the longest dependency an N-layer model can use grows as O(N x L); without it, it stops at
the segment). The stream is words of four kinds::

    f7 f30 D k12 v3 f1 f9 ... f22 Q k12 v3 f4 ...

* ``D k v`` defines key ``k`` (one of ``N_KEYS``) with value ``v`` (one of ``N_VALUES``, uniform);
* ``Q k v``, ``distance`` tokens later (value to value), asks for it again: the ``v`` after ``Q k`` is an
  *answer*, predictable only by recalling the definition;
* ``f*`` filler words, uniform and independent of everything, so the filler carries no hint of any
  answer; the value of a definition is itself unpredictable.

Each definition draws its distance log-uniformly from ``[MIN_DISTANCE, MAX_DISTANCE]`` (every octave
gets the same share, from a few tokens to several times n_layer x mem_len of the small models that read
it); a query is written at the first free position once due, so the realised distance can exceed the
drawn one by a few tokens. A key is not redefined while its query is pending, so the latest
definition of a key is its answer. Chance is 1 / N_VALUES for a model that knows an answer is a value.

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

    n_keys: int = 24
    """Distinct keys; more than the definitions usually pending at once (about 6); few, so that each is seen
    often and a small model learns to match them quickly."""
    n_values: int = 16
    """Distinct values: chance accuracy on an answer is 1 / n_values, chance loss ln(n_values)."""
    n_filler: int = 32
    """Distinct filler words."""
    min_distance: int = 3
    """Shortest drawn distance, value to value (3: the query follows the definition's three words)."""
    max_distance: int = 512
    """Longest drawn distance (realised ones may exceed it by a few tokens)."""
    define_rate: float = 0.08
    """Probability that a free position starts a definition (one pair every ~1 / rate filler words)."""
    tokens: tuple[int, int, int] = (2_000_000, 200_000, 200_000)
    """Words in train, valid and test."""
    seed: int = 0


SPLITS = ("train", "valid", "test")
LINE_WORDS = 32
"""Words per line of the written files (lines carry no token: the tokenizer adds no end-of-line)."""
DEFINE, QUERY = "D", "Q"


def generate(n_tokens: int, params: RecallParams, split: int) -> list[str]:
    """The words of one split: filler with definitions and their queries at log-uniform distances."""
    rng = np.random.Generator(np.random.PCG64([params.seed, split]))
    lo, hi = math.log(params.min_distance), math.log(params.max_distance)
    words: list[str] = []
    pending: list[tuple[int, int, int, int]] = []  # (due position of the query's value, order, key, value)
    free = list(range(params.n_keys))
    order = 0
    while len(words) < n_tokens:
        pos = len(words)
        if pending and pending[0][0] <= pos + 2:  # due: "Q k v" puts the answer at pos + 2
            _, _, key, value = heapq.heappop(pending)
            words += [QUERY, f"k{key}", f"v{value}"]
            free.append(key)
        elif free and rng.random() < params.define_rate:
            key = free.pop(int(rng.integers(len(free))))
            value = int(rng.integers(params.n_values))
            distance = int(round(math.exp(rng.uniform(lo, hi))))
            words += [DEFINE, f"k{key}", f"v{value}"]
            heapq.heappush(pending, (pos + 2 + distance, order, key, value))
            order += 1
        else:
            words.append(f"f{int(rng.integers(params.n_filler))}")
    return words[:n_tokens]


def answers(tokens: np.ndarray, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """(positions, distances) of every answer in ``tokens``: the value after ``Q k``, and how many tokens
    after the value of ``k``'s latest definition it stands. Queries whose definition is not in ``tokens``
    (a cut stream) or whose value runs past the end are left out. int64 arrays, positions increasing."""
    index = tokenizer.vocab.index
    define, query = index[DEFINE], index[QUERY]
    toks = np.asarray(tokens, dtype=np.int64)
    marks = np.flatnonzero((toks == define) | (toks == query))
    latest: dict[int, int] = {}
    positions, distances = [], []
    for m in marks:
        if m + 2 >= len(toks):
            break
        key = int(toks[m + 1])
        if toks[m] == define:
            latest[key] = m + 2
        elif key in latest:
            positions.append(m + 2)
            distances.append(m + 2 - latest.pop(key))
    return np.asarray(positions, dtype=np.int64), np.asarray(distances, dtype=np.int64)


def build_recall_corpus(cache_dir: Path, params: RecallParams | None = None) -> Path:
    """Write (or find) the three split files under ``cache_dir``; return the directory holding them."""
    params = RecallParams() if params is None else params
    key = cache.cache_key({"kind": "recall", "version": 1, **asdict(params)})
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
