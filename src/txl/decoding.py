"""The one decoding core under `txl.generate`, `txl score` and `txl serve`.

Shape legend: B rows, T tokens per row in a unit, L layers, M memory rows of the batch (rows left-padded to
it), d d_model, H heads, D head width, V vocabulary.

Every reader of a model here is made of these parts, so the library and the server compute alike:

* ``read`` scores a (B, T) segment against a memory (txl score's documents, a session's text);
* ``Decoder.run`` is the one unit of generation: it reads (B, T) tokens after a batch of ``Rows`` (prefill:
  a prompt or a session's unfinished segment; step: one token) and returns the next token's (B, V)
  log-probabilities and the new rows. Rows are left-padded (pad keys masked through ``padding=``, which
  relative attention does not notice, so a row computes what it computes alone) and always on the model's
  device in its dtype, whatever device they were kept on (a session read back from disk is on the CPU);
* the memory and the cached keys/values grow in preallocated ``RowBuffer`` storage of a fixed stride
  (``txl.model.memory``): a step appends one row in place, and with a ``mem_len`` (a sliding window) the
  window moves along the buffer; a buffer is replaced (its last rows copied once) every 64 steps, never
  grown by ``torch.cat`` per token;
* ``Picker`` turns log-probabilities into tokens: repetition penalty (CTRL), temperature / top-k / top-p
  sampling with a generator per row (row b of a seeded call: ``seed + b``) or one shared, stop tokens and
  the top log-probabilities; ``check_sampling`` is the one check of its settings;
* ``StopText`` finds stop texts in a growing text and holds back what could still become one (streaming).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from txl.compiled_step import CompiledStep, compiled_step_error, room
from txl.config import Context
from txl.config import check_sampling as check_sampling_values
from txl.model.kv_cache import KVCache, weights_version
from txl.model.memory import memory_length
from txl.runtime import compile_model
from txl.sampling import apply_repetition_penalty, sample_next

__all__ = ["BIG", "Decoder", "Picked", "Picker", "Rows", "StopText", "check_sampling", "positive_int", "read"]

BIG = 1 << 30
"""mem_len of a generation that drops nothing it read (the default of `txl generate` and the server's)."""


def positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def check_sampling(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                   repetition_penalty: float = 1.0) -> None:
    """Raise a ValueError naming the bad sampling parameter, before any work is done (the rule of
    ``txl.config.check_sampling``, which the server's request models apply too)."""
    positive_int("max_new_tokens", max_new_tokens, minimum=0)
    check_sampling_values(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)


# -- reading ----------------------------------------------------------------------------------------------------

def read(model, x: torch.Tensor, y: torch.Tensor, memory, *, context: Context, kv_cache: KVCache | None = None,
         padding: torch.Tensor | None = None):
    """Score a (B, T) segment: log p(y[b, t] | x[b, :t + 1], memory) as (B, T) float64 on the CPU, and the
    model's output (its memory and kv_cache for the next segment). Eval mode, no autograd: the caller's."""
    out = model(x, labels=y, memory=memory, context=context, padding=padding, kv_cache=kv_cache,
                return_log_probs=False)
    return (-out.nll).double().cpu(), out


# -- generation rows ----------------------------------------------------------------------------------------------

@dataclass
class Rows:
    """A generation batch: B rows left-padded to M, per layer, on the model's device in its dtype."""

    memory: tuple[torch.Tensor, ...]
    """One (B, M, d) tensor per layer (() while nothing is read)."""
    keys: tuple[torch.Tensor, ...]
    """One (B, M, H, D) tensor per layer (() when the attention cannot cache, or the cache is to be rebuilt)."""
    values: tuple[torch.Tensor, ...]
    pads: list[int]
    """Each row's pads: its first pads[b] of the M rows (pads are always the leading rows)."""
    buffers: tuple = ()
    """The KVCache's RowBuffers that memory, keys and values are views of (the next unit appends to them in
    place); () for rows gathered or selected into new tensors."""
    version: int | None = None
    """The weights' version the keys were projected with (``kv_cache.weights_version``)."""

    @property
    def size(self) -> int:
        return len(self.pads)

    @property
    def length(self) -> int:
        return memory_length(self.memory)

    def padding(self, T: int, pads: Sequence[int] | None = None, device: torch.device | None = None
                ) -> torch.Tensor | None:
        """(B, M + T) bool over the rows and T more positions, True at the pads (``pads``: each row's, when T
        positions of padding follow its own); None when no row is padded."""
        pads = self.pads if pads is None else pads
        if not any(pads):
            return None
        device = device or (self.memory[0].device if self.memory else None)
        pos = torch.arange(self.length + T, device=device)  # (M + T,)
        return pos[None, :] < torch.tensor(pads, device=device)[:, None]  # (B, M + T)

    @classmethod
    def empty(cls, batch_size: int) -> Rows:
        return cls((), (), (), [0] * batch_size)

    def take(self, b: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Row b alone: its memory (L, m, d) and keys, values (L, m, H, D) (None without a cache)."""
        p = self.pads[b]
        mem = torch.stack([m[b, p:] for m in self.memory])  # (L, m, d)
        kv = (torch.stack([k[b, p:] for k in self.keys]), torch.stack([v[b, p:] for v in self.values])
              ) if self.keys else None
        return mem, kv

    def select(self, idx: list[int]) -> Rows:
        """The rows ``idx`` as a batch (the pad columns they all share dropped)."""
        cut = min(self.pads[b] for b in idx)
        i = torch.tensor(idx, device=self.memory[0].device)

        def pick(ts):
            return tuple(t.index_select(0, i)[:, cut:] for t in ts)  # (B', M - cut, ...)

        return Rows(pick(self.memory), pick(self.keys), pick(self.values), [self.pads[b] - cut for b in idx],
                    version=self.version)

    @classmethod
    def gather(cls, parts: Sequence[tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]], *,
               cached: bool, device: torch.device, dtype: torch.dtype, version: int | None = None) -> Rows:
        """Rows of their own (memory (L, m_b, d) or None, and their keys and values (L, m_b, H, D) each or None)
        as one left-padded batch on ``device`` in ``dtype``. Keys are kept only when every row has them
        (``cached``): otherwise the model projects them again from the memory."""
        mem, pads = _left_pad([m for m, _ in parts], device, dtype)
        keys = values = ()
        if cached and mem is not None and all(kv is not None or m is None or m.size(1) == 0 for m, kv in parts):
            k, _ = _left_pad([kv[0] if kv is not None else None for _, kv in parts], device, dtype)  # (L, B, M, H, D)
            v, _ = _left_pad([kv[1] if kv is not None else None for _, kv in parts], device, dtype)
            keys, values = tuple(k.unbind(0)), tuple(v.unbind(0))
        return cls(() if mem is None else tuple(mem.unbind(0)), keys, values, pads, version=version)


def _left_pad(rows: list[torch.Tensor | None], device, dtype) -> tuple[torch.Tensor | None, list[int]]:
    """Stack (L, m_b, ...) rows into (L, B, M, ...) on ``device`` in ``dtype``, left-padded with zeros; and each
    row's pad count."""
    lengths = [0 if r is None else r.size(1) for r in rows]
    M = max(lengths)
    if M == 0:
        return None, lengths
    if min(lengths) == M:  # all rows full (the usual case when reading): one copy, no zeros
        return torch.stack([r.to(device=device, dtype=dtype) for r in rows], 1), [0] * len(rows)  # (L, B, M, ...)
    first = next(r for r in rows if r is not None)
    out = torch.zeros(first.size(0), len(rows), M, *first.shape[2:], dtype=dtype, device=device)  # (L, B, M, ...)
    for b, r in enumerate(rows):
        if r is not None and r.size(1):
            out[:, b, M - r.size(1):] = r  # copy_ moves it to out's device and dtype
    return out, [M - n for n in lengths]


class Decoder:
    """A model's generation units: ``run(ids, rows)`` reads (B, T) tokens after ``rows`` and returns the
    (B, V) float32 log-probabilities of each row's next token and the rows that now include the tokens.

    Generation context: ``mem_len`` (None: every position read is kept; else a sliding window of the last
    ``mem_len``), same_length off and ext_len 0 (both only make sense for fixed training or evaluation
    segments), ``clamp_len`` as given (None: the model's). Holds no model state but the positional table
    its KV caches share; the memory and keys live in the ``Rows`` it returns. ``check_weights``: rebuild
    cached keys whose weights changed since (a model between training steps); a server never changes them.

    ``compile``: the (B, 1) steps run as one torch.compile graph (``txl.compiled_step``: symbolic sizes, so the
    growing memory never recompiles it; the rows are written in place into the same buffers as eagerly), the prefill
    eagerly (compute-bound, and of a new length each time); for an encoding the compiled step cannot read (absolute,
    Shaw's, rotary, a compressed memory) the whole forward goes through torch.compile instead. ``backend``:
    torch.compile's (None: inductor).
    """

    def __init__(self, model, *, mem_len: int | None = None, clamp_len: int | None = None, compile: bool = False,
                 check_weights: bool = True, backend=None) -> None:
        self.model = model
        self.compiled = None
        if compile and compiled_step_error(model) is None:
            self.compiled = CompiledStep(model, backend=backend)
            compile = False  # the prefill runs eagerly
        self.forward = compile_model(model, compile)  # the model itself unless compile
        self.context = model.config.context(mem_len=mem_len or BIG, same_length=False, clamp_len=clamp_len,
                                            ext_len=0)
        self.cacheable = model.start_kv_cache() is not None
        self.check_weights = check_weights
        self.version = weights_version(model)
        self.table: tuple[torch.Tensor, ...] = ()  # the relative positions' W_kR R, grown as needed, shared
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def rows(self, parts, *, cached: bool = True) -> Rows:
        """``Rows.gather`` on this model's device, in its dtype."""
        return Rows.gather(parts, cached=cached and self.cacheable, device=self.device, dtype=self.dtype,
                           version=self.version)

    @torch.no_grad()
    def run(self, ids: torch.Tensor, rows: Rows | None = None, lead: Sequence[int] | None = None
            ) -> tuple[torch.Tensor, Rows]:
        """Read (B, T) ``ids`` after ``rows`` (None: nothing read yet); ``lead``: each row's pads at the start of
        ``ids`` (a left-padded prompt), allowed only where everything before them is padding too."""
        B, T = ids.shape
        rows = rows if rows is not None else Rows.empty(B)
        M = rows.length
        if lead is not None and any(n and p != M for p, n in zip(rows.pads, lead)):
            raise ValueError("pads inside a row: a row's pads must come before everything it has read")
        pads = [p + (n if lead is not None else 0) for p, n in zip(rows.pads, lead or [0] * B)]
        cache = None
        if self.cacheable:
            if self.check_weights:
                self.version = weights_version(self.model)
            if rows.version != self.version:  # keys of other weights (or none): projected again from the memory
                rows = Rows(rows.memory, (), (), rows.pads)
        if self.compiled is not None and T == 1 and M:
            return self._compiled_step(ids, rows, pads)
        padding = rows.padding(T, pads, self.device)
        if self.cacheable:
            cache = KVCache(keys=rows.keys, values=rows.values, positions=self.table, buffers=rows.buffers,
                            weights_version=self.version)
        out = self.forward(ids, memory=rows.memory or None, context=self.context, padding=padding, kv_cache=cache,
                           return_log_probs=False)
        # Only the last position is needed: score it alone, not the (B, T, V) of the whole input.
        next_lp = self.model.softmax.log_prob(out.hidden[:, -1]).float()  # (B, V)
        dropped = M + T - memory_length(out.memory)  # a sliding window's oldest rows
        kv = out.kv_cache
        if kv is not None:
            self.table = kv.positions
        new = Rows(tuple(out.memory), tuple(kv.keys) if kv is not None else (),
                   tuple(kv.values) if kv is not None else (), [max(p - dropped, 0) for p in pads],
                   kv.buffers if kv is not None else (), self.version)  # (B, M', ...) per layer
        return next_lp, new

    def _compiled_step(self, ids: torch.Tensor, rows: Rows, pads: list[int]) -> tuple[torch.Tensor, Rows]:
        """``run`` of a (B, 1) step through the compiled step: the new row is written in place into the rows'
        buffers (new ones when they have none or are full)."""
        M, L = rows.length, len(rows.memory)
        keys, values, had = rows.keys, rows.values, [None] * (3 * L)
        if not keys:  # keys of other weights, or none kept: projected once from the memory
            keys, values = zip(*(layer.attn.keys_values(m) for layer, m in zip(self.model.layers, rows.memory)))
        elif rows.buffers:
            had = [b[i] for i in range(3) for b in rows.buffers]  # the memories, then the keys, then the values
        buffers = room([*rows.memory, *keys, *values], had)
        n = buffers[0].end
        self.table = self.model.encoding.grow_table([layer.attn for layer in self.model.layers], self.table, M + 1,
                                                    self.context.clamp_len, d_model=self.model.config.d_model,
                                                    dtype=self.dtype, device=self.device)
        next_lp = self.compiled(ids, buffers, n - M, self.table, pads)  # (B, V)
        kept = min(M + 1, self.context.mem_len)  # a sliding window keeps the last mem_len rows
        dropped = M + 1 - kept

        def window(bufs):
            return tuple(b.data[:, n + 1 - kept:n + 1] for b in bufs)  # (B, M', ...) views

        new = Rows(window(buffers[:L]), window(buffers[L:2 * L]), window(buffers[2 * L:]),
                   [max(p - dropped, 0) for p in pads], tuple(zip(buffers[:L], buffers[L:2 * L], buffers[2 * L:])),
                   self.version)
        return next_lp, new


# -- choosing tokens ---------------------------------------------------------------------------------------------

@dataclass
class Picked:
    tokens: torch.Tensor
    """(B,) int64: each row's token."""
    logprobs: torch.Tensor
    """(B,) float32: its log-probability under the model (before any penalty or filter)."""
    top: list[list[tuple[int, float]]] | None
    """Each row's ``top_logprobs`` most likely (id, log-prob), most likely first; None when not asked for."""
    stopped: torch.Tensor
    """(B,) bool: the token is one of the stop tokens."""


class Picker:
    """The next token of each of B rows, from their (B, V) log-probabilities.

    Order: the repetition penalty (CTRL, Keskar et al. 2019: tokens ``seen`` in the row), then
    temperature, top-k and top-p (``txl.sampling.sample_next``; temperature 0 is greedy). Randomness comes
    from ``seeds`` (row b: its own generator seeded ``seeds[b]``, so a row's draws never depend on the
    other rows) or from ``generator``, shared by the rows (neither: torch's global generator).
    """

    def __init__(self, *, temperature: float, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 seeds: Sequence[int] | None = None, generator: torch.Generator | None = None,
                 stop_tokens: Sequence[int] = (), top_logprobs: int = 0, vocab_size: int,
                 device: torch.device | str = "cpu") -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.penalty, self.top_logprobs, self.generator = repetition_penalty, top_logprobs, generator
        self.generators = None
        if seeds is not None:
            self.generators = [torch.Generator(device).manual_seed(int(s)) for s in seeds]
        stops = sorted({int(t) for t in stop_tokens})
        if stops and (stops[0] < 0 or stops[-1] >= vocab_size):
            raise ValueError(f"stop_tokens {stops} must be ids in 0..{vocab_size - 1}")
        self.stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
        self.stop_set = frozenset(stops)  # the host's copy: a token the host has read is checked without the device
        self.vocab_size, self.device = vocab_size, device
        self.seen: torch.Tensor | None = None

    def see(self, ids: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Count (B, T) ``ids`` as read by their rows (``real``: (B, T) bool, False at pads) for the penalty."""
        if self.penalty == 1.0:
            return
        B = ids.size(0)
        if self.seen is None:
            self.seen = torch.zeros(B, self.vocab_size, dtype=torch.bool, device=ids.device)  # (B, V)
        count = torch.ones_like(ids) if real is None else real.long()  # (B, T)
        self.seen |= torch.zeros(B, self.vocab_size, dtype=torch.long, device=ids.device).scatter_add_(
            1, ids, count) > 0

    def __call__(self, log_probs: torch.Tensor, live: torch.Tensor | None = None) -> Picked:
        """Draw each row's token from (B, V) ``log_probs``; rows not ``live`` ((B,) bool) are not counted as
        seeing theirs."""
        scores = log_probs
        if self.penalty != 1.0:
            if self.seen is None:
                self.seen = torch.zeros_like(log_probs, dtype=torch.bool)  # (B, V)
            scores = apply_repetition_penalty(log_probs, self.seen, self.penalty)
        if self.generators is None:
            tokens = sample_next(scores, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                 generator=self.generator)  # (B,)
        else:
            tokens = torch.cat([sample_next(scores[b:b + 1], temperature=self.temperature, top_k=self.top_k,
                                            top_p=self.top_p, generator=g) for b, g in enumerate(self.generators)])
        chosen = log_probs.gather(1, tokens[:, None]).squeeze(1)  # (B,)
        top = None
        if self.top_logprobs:
            values, idx = log_probs.topk(min(self.top_logprobs, log_probs.size(1)))  # (B, k) each
            top = [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]
        if self.seen is not None:
            rows = torch.arange(tokens.size(0), device=tokens.device)
            if live is not None:
                rows, picked = rows[live], tokens[live]
            else:
                picked = tokens
            self.seen[rows, picked] = True
        stopped = torch.isin(tokens, self.stop_ids.to(tokens.device)) if self.stop_ids.numel() else \
            torch.zeros_like(tokens, dtype=torch.bool)
        return Picked(tokens, chosen, top, stopped)


# -- stop texts ----------------------------------------------------------------------------------------------------

class StopText:
    """The first of ``stops`` in a growing text, and what of the text may be shown while it grows.

    ``update(text)`` gives the text so far (each call a longer one, or the same text decoded again);
    ``stopped`` becomes True once it contains a stop text, and ``text`` is then cut before it. ``show()``
    returns the text not shown yet that no stop text can still begin in (the last len(longest stop) - 1
    characters are held back while more may come); ``finish()`` returns the rest.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("a stop text is empty; every stop text needs at least one character")
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.shown, self.searched = "", 0, 0
        self.stopped = False

    def update(self, text: str) -> bool:
        if self.stopped:
            return True
        self.text = text
        start = max(0, min(self.searched, len(text)) - self.hold)  # a stop may straddle the last search's end
        cuts = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if cuts:
            self.text, self.stopped = text[:min(cuts)], True
        self.searched = len(self.text)
        return self.stopped

    def push(self, piece: str) -> bool:
        return self.update(self.text + piece)

    def show(self) -> str:
        end = len(self.text) if self.stopped else len(self.text) - self.hold
        if end <= self.shown:
            return ""
        piece, self.shown = self.text[self.shown:end], end
        return piece

    def finish(self) -> str:
        piece, self.shown = self.text[self.shown:], len(self.text)
        return piece
