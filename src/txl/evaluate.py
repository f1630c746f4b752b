"""Evaluation: loss, perplexity or bits per character over a split, in any attention context.

Transformer-XL is trained with one memory length and evaluated with a longer one (Dai et al. 2019,
section 3.2: the effective context grows with the memory); the context is an argument of the forward pass
(``txl.Context``), as the memory is, since these fields own no parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from txl.config import Context
from txl.distributed import DistInfo, all_reduce_sum
from txl.graphs import StaticSteps
from txl.labels import IGNORE_INDEX
from txl.model import TransformerXL
from txl.model.transformer import check_token_ids
from txl.runtime import compile_model
from txl.static_eval import StaticEval, static_eval_error

if TYPE_CHECKING:
    from txl.data import OrderedIterator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Mean NLL per token, in nats."""
    tokens: int
    seconds: float
    metric: str
    """'ppl' or 'bpc'."""

    @property
    def value(self) -> float:
        return metric_value(self.loss, self.metric)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def describe(self) -> str:
        return (f"loss {self.loss:.4f}, {self.metric} {self.value:.4f}, {self.tokens:,} tokens, "
                f"{self.tokens_per_s:,.0f} tokens/s")


def metric_value(loss: float, metric: str) -> float:
    """Perplexity exp(loss) for words, bits per character loss / ln 2 for bytes and characters."""
    if metric == "bpc":
        return loss / math.log(2)
    return math.exp(min(loss, 700.0))


@contextlib.contextmanager
def inference_context(model: TransformerXL, **changes: object) -> Iterator[Context]:
    """Eval mode and no autograd for the duration; yields the ``Context`` to pass to ``model(..., context=)``:
    the config's, with ``changes`` (mem_len, clamp_len, same_length, same_length_style, ext_len; None keeps a
    field). The model's training flag is restored on exit and its config is never changed, so a model in the
    middle of training can be evaluated or sampled from.
    """
    context = model.config.context(**changes)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield context
    finally:
        model.train(was_training)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def check_split_fits(split: str, n_tokens: int, *, batch_size: int, tgt_len: int, flag: str) -> None:
    """Refuse a segment length the split cannot fill once per stream: the evaluation would read shorter
    segments than it reports (txl train, txl eval and the pretrained path share this rule)."""
    need = batch_size * tgt_len + 1
    if n_tokens < need:
        raise ValueError(f"the {split} split has {n_tokens:,} tokens, fewer than eval.batch_size x tgt_len + 1 "
                         f"= {batch_size} x {tgt_len} + 1 = {need:,}: use a smaller {flag} or --eval.batch_size, "
                         "or a corpus with a larger split")


def sizes_capacity(model: TransformerXL, static: bool) -> bool:
    """Whether the model's adaptive softmax reads 'capacity' rows: it runs 'capacity', or 'selected' under
    torch.compile or CUDA graphs (``static``), where 'selected' becomes 'capacity'."""
    rows = model.softmax.rows
    return bool(model.softmax.n_clusters) and (rows == "capacity" or (rows == "selected" and static))


def fit_capacity(model: TransformerXL, it: OrderedIterator, chunks: int = 1, *, static: bool = True) -> None:
    """Size the adaptive softmax's 'capacity' rows for every batch ``it`` yields, each cut into ``chunks`` model calls
    (``OrderedIterator.tail_counts``, ``AdaptiveLogSoftmax.fit_capacity``): none of them can overflow. Before anything
    is compiled or captured (their shapes are the rows'); rows only grow. Nothing to count where no rows are read
    (``sizes_capacity``: 'all', or 'selected' run eagerly, ``static`` False)."""
    softmax = model.softmax
    if sizes_capacity(model, static):
        softmax.fit_capacity(it.tail_counts(softmax.bounds[1:-1], chunks))


@torch.no_grad()
def evaluate(model: TransformerXL, tokens: np.ndarray, *, metric: str, batch_size: int, tgt_len: int,
             context: Context | None = None, max_batches: int = 0, precision: str = "fp32",
             info: DistInfo | None = None, compile: bool = False, graphs: bool = False,
             on_segment: Callable[[int, int], None] | None = None) -> EvalResult:
    """Mean NLL of ``tokens`` read as ``batch_size`` streams of ``tgt_len``-token segments carrying memory.

    ``context``: the attention context (``EvalConfig.context(model.config)``); None is the model's own.
    In a process group each rank reads its share of the streams and the sums are all-reduced.
    ``max_batches`` > 0 stops early (periodic validation). ``compile`` runs the forward through torch.compile;
    ``graphs`` the segment captured as a CUDA graph over key/value rings written in place (``txl.static_eval``), or,
    where those do not apply, at one static shape through CUDA graphs (``txl.graphs``).
    ``on_segment(done, total)`` is called after each segment (a progress bar: ``txl.metrics.segment_progress``).
    """
    from txl.data import eval_iterator

    device = next(model.parameters()).device
    if device.type != "cpu":  # the model checks ids on the host only; these move to the device segment by segment
        check_token_ids(tokens, model.config.vocab_size)
    info = info or DistInfo(rank=0, world_size=1, device=device)
    context = model.config.context() if context is None else context
    it = eval_iterator(tokens, batch_size=batch_size, tgt_len=tgt_len, ext_len=context.ext_len, rank=info.rank,
                       world_size=info.world_size, device=device)
    # a split known ahead: 'capacity' rows its batches fit (sized by txl.train already there)
    fit_capacity(model, it, static=compile or graphs)
    why = static_eval_error(model, context) if graphs else "graphs off"
    ring = StaticEval(model, context) if why is None else None
    if graphs and ring is None:
        log.info("eval graphs: through txl.graphs.StaticSteps (the memory copied in and out), not rings: %s", why)
    forward = StaticSteps(model) if graphs and ring is None else compile_model(model, compile)
    total = min(len(it), max_batches) if max_batches else len(it)
    start = time.perf_counter()
    # Sums kept on the device and read once at the end: reading them per segment would wait for each one.
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    with inference_context(model):
        # The weights do not change while evaluating, so the memory rows' keys and values are carried from
        # segment to segment (KVCache) instead of being projected again; absolute encodings cannot be cached.
        cache = model.start_kv_cache()
        memory = None
        for i, batch in enumerate(it):
            if max_batches and i >= max_batches:
                break
            if ring is not None:  # the sums accumulate in its buffers
                with autocast(device, precision):
                    ring(batch.input_ids, batch.labels)
            else:
                with autocast(device, precision):
                    out = forward(batch.input_ids, labels=batch.labels, memory=memory, kv_cache=cache,
                                  context=context)
                memory, cache = out.memory, out.kv_cache
                nll_sum += out.nll.double().sum()
                count += (batch.labels != IGNORE_INDEX).sum()
            if on_segment is not None:
                on_segment(i + 1, total)
    sums = ring.sums() if ring is not None else torch.stack([nll_sum, count.double()])
    nll_sum, count = all_reduce_sum(sums.tolist(), info)
    if count == 0:
        raise ValueError(f"nothing to evaluate: the split has {len(tokens)} tokens")
    return EvalResult(loss=nll_sum / count, tokens=int(count), seconds=time.perf_counter() - start, metric=metric)
