"""Scoring documents: the log-probability of every token, segment by segment with memory.

Shape legend: B documents read together, S segment length, d d_model.

A document of any length is read ``segment_len`` tokens at a time; the memory of the previous
``mem_len`` positions carries the context across segments (Dai et al. 2019, section 3.2), so the work
and the memory used are bounded by the segment and memory lengths, never by the document. Results
stream out segment by segment.

Many documents are read together, right-padded: attention is causal, so padding after a document's
end never changes its scores, and every document starts at position 0 with an empty memory, so
scoring documents together gives the same numbers as scoring each alone (a test proves it).

Token 0 of a document has no context; it is scored only when ``context_id`` is given (e.g. the
``<eos>`` that precedes every line in WikiText), which is then read first as the context.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from txl.config import Context
from txl.decoding import read
from txl.evaluate import inference_context, sizes_capacity
from txl.labels import IGNORE_INDEX
from txl.model import Memory, TransformerXL
from txl.static_eval import StaticEval, static_eval_error

__all__ = ["DocumentScore", "ScoredSegment", "iter_scores", "score_documents"]

log = logging.getLogger(__name__)


@dataclass
class ScoredSegment:
    """The scores of one segment of one document, as soon as they are computed."""

    doc: int
    """Index of the document in the list given."""
    start: int
    """Position in the document of the first token scored here."""
    token_ids: np.ndarray
    """(n,) int64 ids of the tokens scored."""
    logprobs: np.ndarray
    """(n,) float64 natural-log probability of each token given everything before it."""


@dataclass
class DocumentScore:
    """The totals of one document, emitted when its last token has been scored."""

    doc: int
    n_tokens: int
    """Tokens scored (the length, less one when the first token had no context)."""
    nll: float
    """Summed negative log-likelihood in nats."""
    logprobs: np.ndarray | None = field(default=None, repr=False)
    """(n_tokens,) per-token log-probabilities, when asked for with keep_logprobs."""

    # A document with no token scored (empty, or one token and no context_id) has no mean: these figures are
    # None for it, as `txl score` writes null, rather than NaN (a NaN is not a measurement, and is not JSON).
    @property
    def mean_nll(self) -> float | None:
        """Mean NLL per token in nats; None when no token was scored."""
        return self.nll / self.n_tokens if self.n_tokens else None

    @property
    def perplexity(self) -> float | None:
        """exp(mean NLL): word-level perplexity for a word vocabulary; None when no token was scored."""
        return math.exp(self.nll / self.n_tokens) if self.n_tokens else None

    @property
    def bits_per_token(self) -> float | None:
        """Mean NLL in bits: bits per character (or byte) for a character (or byte) vocabulary; None when no
        token was scored."""
        return self.nll / self.n_tokens / math.log(2) if self.n_tokens else None


class _Reader:
    """Hands out a document's ids a few at a time, from a sequence (sliced) or an iterator (pulled)."""

    def __init__(self, doc: Iterable[int]) -> None:
        if isinstance(doc, torch.Tensor):
            doc = doc.detach().cpu().numpy()
        self.seq = doc if hasattr(doc, "__getitem__") and hasattr(doc, "__len__") else None
        self.it = None if self.seq is not None else iter(doc)
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        if self.seq is not None:
            chunk = self.seq[self.pos:self.pos + n]
        else:
            chunk = list(itertools.islice(self.it, n))
        self.pos += len(chunk)
        return np.asarray(chunk, dtype=np.int64).reshape(-1)


@dataclass
class _Row:
    doc: int
    reader: _Reader
    carry: int = -1
    """The last token read: the input that predicts the next one."""
    scored: int = 0
    nll: float = 0.0
    done: bool = False
    kept: list[np.ndarray] = field(default_factory=list)


def _check(segment_len: int, batch_size: int, vocab_size: int, context_id: int | None) -> None:
    for name, value in (("segment_len", segment_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if context_id is not None and not 0 <= context_id < vocab_size:
        raise ValueError(f"context_id={context_id} is out of range for vocab_size={vocab_size}")


def _group(documents: Sequence[Iterable[int]], batch_size: int) -> list[list[int]]:
    """Document indices in batches; sorted by length when lengths are known, to waste less padding."""
    order = list(range(len(documents)))
    if all(hasattr(d, "__len__") for d in documents):
        order.sort(key=lambda i: len(documents[i]))  # type: ignore[arg-type]
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _fit_capacity(model: TransformerXL, documents: Sequence[Iterable[int]], *, batch_size: int, segment_len: int,
                  context_id: int | None, static: bool) -> None:
    """Size the adaptive softmax's 'capacity' rows (``AdaptiveLogSoftmax.fit_capacity``) for every segment of
    ``documents`` where their lengths are known ahead (sequences, not iterators): per group read together and per
    segment, each tail's labels (a document's ids, less the first without ``context_id``). Iterators: the Zipf
    estimate stays (a NaN score is a tail holding more labels than its rows)."""
    softmax = model.softmax
    if not sizes_capacity(model, static) or not all(hasattr(d, "__len__") for d in documents):
        return
    cutoffs, most = softmax.bounds[1:-1], np.zeros(softmax.n_clusters, dtype=np.int64)
    for group in _group(documents, batch_size):
        first = 0 if context_id is not None else 1  # without a context id the first token is context only
        labels = [np.asarray(documents[i], dtype=np.int64)[first:] for i in group]  # (n_i,) each
        per_segment = np.zeros((max(-(-len(y) // segment_len) for y in labels), len(cutoffs) + 1), dtype=np.int64)
        for y in labels:  # (segments, C + 1): each segment's labels per cluster, the group's documents summed
            np.add.at(per_segment, (np.arange(len(y)) // segment_len, np.searchsorted(cutoffs, y, side="right")), 1)
        most = np.maximum(most, per_segment[:, 1:].max(0, initial=0))
    softmax.fit_capacity(most.tolist())


def _ring_read(ring: StaticEval, rows: int, width: int, x: torch.Tensor, y: torch.Tensor, device: torch.device
               ) -> torch.Tensor:
    """``read``'s (B, S) log-probabilities through the rings (``txl.static_eval``): every segment at the rings' one
    shape, ``rows`` x ``width`` (segment_len), the rows and positions past the group's padded (read, never scored; a
    short segment is a group's last, and the next group starts the streams again), so each replays one graph."""
    B, S = x.shape
    pad_x = torch.zeros(rows, width, dtype=x.dtype)  # (rows, segment_len); padding reads token 0
    pad_y = torch.full_like(pad_x, IGNORE_INDEX)  # (rows, segment_len); padding is not scored
    pad_x[:B, :S], pad_y[:B, :S] = x, y
    return (-ring(pad_x.to(device), pad_y.to(device))[:B, :S]).double().cpu()  # (B, S)


def _score_group(model: TransformerXL, rows: list[_Row], *, segment_len: int, context_id: int | None,
                 keep_logprobs: bool, device: torch.device, context: Context,
                 ring: tuple[StaticEval, int, int] | None = None) -> Iterator[ScoredSegment | DocumentScore]:
    for row in rows:
        first = row.reader.take(1) if context_id is None else np.array([context_id])
        row.done = len(first) == 0
        row.carry = int(first[0]) if len(first) else 0
        if row.done:  # an empty document: nothing to score
            yield DocumentScore(doc=row.doc, n_tokens=0, nll=0.0, logprobs=np.zeros(0) if keep_logprobs else None)
    memory: Memory | None = None
    # The memory rows' keys and values are carried, not projected again (as txl.evaluate).
    cache = model.start_kv_cache()
    while not all(r.done for r in rows):
        new = [r.reader.take(segment_len) if not r.done else np.zeros(0, np.int64) for r in rows]
        n = max(len(ids) for ids in new)
        x = torch.zeros(len(rows), max(n, 1), dtype=torch.long)  # (B, S); padding reads token 0
        y = torch.full_like(x, IGNORE_INDEX)  # (B, S); padding is not scored
        for b, (row, ids) in enumerate(zip(rows, new)):
            if len(ids):
                x[b, 0], x[b, 1:len(ids)] = row.carry, torch.from_numpy(ids[:-1])
                y[b, :len(ids)] = torch.from_numpy(ids)
                row.carry = int(ids[-1])
        if n and ring is not None:
            logprobs = _ring_read(*ring, x, y, device).numpy()  # (B, S)
        elif n:
            lp, out = read(model, x.to(device), y.to(device), memory, context=context, kv_cache=cache)
            memory, cache = out.memory, out.kv_cache
            logprobs = lp.numpy()  # (B, S)
        for b, (row, ids) in enumerate(zip(rows, new)):
            if row.done:
                continue
            if len(ids):
                lp = logprobs[b, :len(ids)]
                yield ScoredSegment(doc=row.doc, start=row.scored + (context_id is None), token_ids=ids,
                                    logprobs=lp)
                row.scored += len(ids)
                row.nll -= float(lp.sum())
                if keep_logprobs:
                    row.kept.append(lp)
            if len(ids) < segment_len:  # the reader ran dry: the document is complete
                row.done = True
                kept = np.concatenate(row.kept) if row.kept else np.zeros(0)
                yield DocumentScore(doc=row.doc, n_tokens=row.scored, nll=row.nll,
                                    logprobs=kept if keep_logprobs else None)


def iter_scores(model: TransformerXL, documents: Sequence[Iterable[int]], *, segment_len: int = 128,
                batch_size: int = 8, mem_len: int | None = None, same_length: bool | None = None,
                clamp_len: int | None = None, context_id: int | None = None,
                keep_logprobs: bool = False, graphs: bool = False) -> Iterator[ScoredSegment | DocumentScore]:
    """Stream the scores of ``documents`` (each a sequence or an iterator of token ids).

    Yields a :class:`ScoredSegment` for each document and segment as it is computed, and a
    :class:`DocumentScore` when a document ends. ``batch_size`` documents are read together. The
    evaluation context (``mem_len``, ``same_length``, ``clamp_len``) defaults to the model's config
    (a Hugging Face wt103 checkpoint carries the paper's: mem_len 1600, same_length, clamp_len 1000);
    ``ext_len`` is 0. The model is in eval mode without autograd while scoring, and left as it was.
    Arguments are checked when this is called, not at the first ``next()``. ``graphs``: every segment captured as
    one CUDA graph over key/value rings (``txl.static_eval``; compiled on a CPU), where the model allows it.
    """
    _check(segment_len, batch_size, model.config.vocab_size, context_id)
    if mem_len is not None and (isinstance(mem_len, bool) or not isinstance(mem_len, int) or mem_len < 0):
        raise ValueError(f"mem_len={mem_len!r} must be an integer >= 0")
    device = next(model.parameters()).device
    changes = dict(mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, ext_len=0)
    context = model.config.context(**changes)
    _fit_capacity(model, documents, batch_size=batch_size, segment_len=segment_len, context_id=context_id,
                  static=graphs)
    why = static_eval_error(model, context) if graphs else "graphs off"
    if graphs and why is not None:
        log.info("score graphs: the segments run uncaptured, not over rings: %s", why)
    # One shape for every segment and group: the largest group's rows (fewer documents than batch_size: theirs).
    ring = (StaticEval(model, context), min(batch_size, len(documents)), segment_len) if why is None and documents \
        else None

    def items() -> Iterator[ScoredSegment | DocumentScore]:
        for group in _group(documents, batch_size):
            rows = [_Row(doc=i, reader=_Reader(documents[i])) for i in group]
            if ring is not None:
                ring[0].reset()  # each group's documents start from position 0 with nothing in memory
            segments = _score_group(model, rows, segment_len=segment_len, context_id=context_id,
                                    keep_logprobs=keep_logprobs, device=device, context=context, ring=ring)
            while True:
                # The context covers the forward passes only: nothing leaks to the caller between yields.
                with inference_context(model, **changes):
                    item = next(segments, None)
                if item is None:
                    break
                yield item

    return items()


def score_documents(model: TransformerXL, documents: Sequence[Iterable[int]], **kwargs) -> list[DocumentScore]:
    """The :class:`DocumentScore` of each document, in the order given (arguments of :func:`iter_scores`)."""
    results = [r for r in iter_scores(model, documents, **kwargs) if isinstance(r, DocumentScore)]
    return sorted(results, key=lambda r: r.doc)
