"""The model runner: the model and the batched forward passes of the engine's units of work.

Shape legend: B rows (sessions) in a batch, T tokens per row, L layers, m a row's memory rows, M the
longest (rows are left-padded to it), d d_model, H heads, D head width, V vocabulary.

A unit is one row of model work (read a segment, start a generation, one generation step); ``Model.run`` takes a
group of units of the same kind and length (the scheduler's, ``txl.serve.scheduler``) and runs them as one forward
pass (dynamic batching): rows with shorter memories are left-padded and the pads masked as keys (``padding=`` of the
model's forward), which relative attention does not notice, so a row computes what it would alone (a test proves it).

A generation's rows stay batched between its steps (``Rows``): a step whose rows all come from one batch
steps that batch's tensors as they are (or the subset still running, one index_select per tensor), so the
per-step cost does not grow with copying every row's memory and keys/values in and out; rows from different
batches (a generation joining others) are gathered once into a new batch.

Reading uses the session's context (segment_len, mem_len, same_length, clamp_len: as `txl score`, through
``txl.decoding.read``). Generation continues from the memory as `txl generate` does, with its units
(``txl.decoding.Decoder``: same_length off, the memory growing with the tokens generated, keys and values cached,
rows on the model's device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from txl.captured_step import StepGraphs
from txl.compiled_step import compiled_step_error
from txl.config import Context
from txl.decoding import Decoder, Picker, Rows, read
from txl.serve.slots import Seat, Slots

__all__ = ["Drawn", "Model", "Result", "Unit", "draw"]


@dataclass
class Unit:
    """One row of model work. kind 'score': inputs and labels from ``memory`` (L, m, d); 'prefill': inputs
    from ``memory``, keeping every row (the generation's memory and keys/values); 'step': one input from a
    generation's ``memory`` and ``kv`` ((L, m, H, D) keys, values)."""

    kind: str
    inputs: list[int]
    memory: torch.Tensor | None = None
    labels: list[int] | None = None
    kv: tuple[torch.Tensor, torch.Tensor] | None = None
    with_memory: bool = True
    row: tuple[Rows, int] | None = None
    """'step': the row of a generation batch it continues (instead of ``memory`` and ``kv``)."""
    top: int = 0
    """'score': also the ``top`` most likely tokens at each position (a completion's echoed prompt)."""
    compressed: torch.Tensor | None = None
    """A compressive model's (cmem_len > 0) compressed memory (L, C, d) beside ``memory`` (None: empty)."""
    pick: Picker | None = None
    """'prefill' and 'step': the generation's sampler (on the model's device): the runner draws the next token with
    it on the device (``Result.drawn``); None: only the log-probabilities (``Result.next_log_probs``)."""
    after: tuple[Drawn, int] | None = None
    """'step': where its input token was drawn (the last step's ``Result.drawn``): read there, on the device, rather
    than copied from ``inputs`` (which holds the same id, or -1 when the host has not read it)."""

    @property
    def key(self) -> tuple[str, int]:
        return self.kind, len(self.inputs)



@dataclass
class Result:
    logprobs: list[float] | None = None
    """'score': log p(labels[t]) for each t."""
    next_log_probs: torch.Tensor | None = None
    """'prefill' and 'step': (V,) log-probabilities of the next token, on the model's device."""
    memory: torch.Tensor | None = None
    """'score': the row's new memory (L, m', d)."""
    compressed: torch.Tensor | None = None
    """'score', a compressive model: the row's new compressed memory (L, C', d)."""
    row: tuple[Rows, int] | None = None
    """'prefill' and 'step': the row in the generation batch (``Rows.take`` gives its memory, keys, values)."""
    top: list[tuple[list[int], list[float]]] | None = None
    """'score' with ``Unit.top``: at each position, the most likely next tokens' ids and log-probs."""
    drawn: tuple[Drawn, int] | None = None
    """'prefill' and 'step' with ``Unit.pick``: the batch's drawn tokens and this row's index in them."""


class Drawn:
    """The tokens a generation batch drew: on the device, where the next step reads them as its input, and on
    their way to the host, with one small copy (ids and their log-probabilities, (2, B)) that the host waits for
    only when it reads them (``get``): on CUDA a non-blocking copy into pinned memory and an event, so the device
    runs on while the host learns the tokens."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor,
                 tops: list[list[tuple[int, float]] | None]) -> None:
        self.tokens = tokens  # (B,) int64 on the device
        self.tops = tops
        packed = torch.stack([tokens.double(), logprobs.double()])  # (2, B): ids below 2**53 are exact in float64
        self._event = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)  # (2, B)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed
        self._values: tuple[list[int], list[float]] | None = None

    def __len__(self) -> int:
        return len(self.tops)

    def get(self, b: int) -> tuple[int, float, list[tuple[int, float]] | None]:
        """Row b's token, its log-probability under the model, and its top alternatives (None: not asked)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()  # this step's copy alone, not the device's whole queue
            ids, lps = self._host.tolist()
            self._values = [int(i) for i in ids], lps
        return self._values[0][b], self._values[1][b], self.tops[b]


def draw(log_probs: torch.Tensor, picks: list[Picker], greedy: torch.Tensor | None = None) -> Drawn:
    """Each row's next token from (B, V) ``log_probs`` by its own ``Picker``, on their device. Greedy rows without
    a penalty or alternatives to report (the common case) are one argmax together (``greedy``: (B,) taken already,
    by the captured step); the others as `txl generate` draws them, row by row (a row's seed is its own)."""
    if all(p.temperature == 0 and p.penalty == 1.0 and not p.top_logprobs for p in picks):
        tokens = log_probs.argmax(-1) if greedy is None else greedy  # (B,): what each row's picker would choose
        return Drawn(tokens, log_probs.gather(1, tokens[:, None]).squeeze(1), [None] * len(picks))
    parts = [p(log_probs[b:b + 1]) for b, p in enumerate(picks)]  # (1, V) each
    return Drawn(torch.cat([p.tokens for p in parts]), torch.cat([p.logprobs for p in parts]),
                 [None if p.top is None else p.top[0] for p in parts])


class Model:
    """The model and the batched forward passes of the three kinds of unit: 'score' through
    ``txl.decoding.read`` (as `txl score` reads), 'prefill' and 'step' through ``txl.decoding.Decoder.run``
    (as `txl generate` generates)."""

    def __init__(self, model, *, segment_len: int, context: Context | None = None, mem_len: int | None = None,
                 same_length: bool | None = None, clamp_len: int | None = None, compile: bool = False,
                 graphs: Literal["auto", "on", "off"] = "auto", graph_backend: str | Callable | None = None) -> None:
        """``context``: the reading context (``ServeConfig.context``); or its fields, None being the model's.
        ``compile``: generation steps through one compiled graph (``Decoder``'s ``compile``; with ``graphs``: the
        captured step compiled by inductor before capture). ``graphs``: generation steps in the preallocated slots
        (``txl.serve.slots``), captured as CUDA graphs: 'auto' on CUDA where the model allows it, 'on' wherever the
        model allows it (on a CPU the same step uncaptured: what the tests check), 'off' never.
        ``graph_backend``: torch.compile's backend for that step (None: inductor with ``compile``, else eager)."""
        c = model.config
        self.model = model.eval()
        self.n_layer, self.d_model, self.n_head, self.d_head = c.n_layer, c.d_model, c.n_head, c.d_head
        if context is None:
            context = c.context(mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, ext_len=0)
        self.read_ctx = context
        self.segment_len, self.mem_len = segment_len, context.mem_len
        # A compressive model (Rae et al. 2020): a session carries the memory and the compressed memory, and its
        # rows are batched only with rows of the same lengths (no pads: they would be compressed with real rows).
        self.cmem_len, self.cmem_rate = c.cmem_len, c.cmem_rate
        if c.cmem_len and (context.same_length or context.mem_len == 0):
            raise ValueError(f"a compressive model (cmem_len={c.cmem_len}) reads with a memory and same_length false: "
                             f"serve it with mem_len > 0 (got {context.mem_len}) and same_length false "
                             f"(got {context.same_length})")
        # Generation: the memory keeps every row (BIG), keys and values cached where the attention allows; a
        # server never changes its weights.
        why = compiled_step_error(model)
        if compile and why is not None:
            raise ValueError(f"serve.compile: {why}; serve this model without --serve.compile")
        p = next(model.parameters())
        if graphs == "on" and why is not None:
            raise ValueError(f"serve.graphs on: {why}; serve this model with --serve.graphs auto or off")
        use_slots = why is None and (graphs == "on" or (graphs == "auto" and p.device.type == "cuda"))
        self.decoder = Decoder(model, clamp_len=context.clamp_len, check_weights=False,
                               compile=compile and not use_slots)
        self.device, self.dtype = self.decoder.device, self.decoder.dtype
        self.slots: Slots | None = None
        if use_slots:
            capture = self.device.type == "cuda"
            backend = graph_backend or ("inductor" if compile else None)
            steps = StepGraphs(model, window=self.decoder.context.mem_len, capture=capture, backend=backend)
            self.slots = Slots(model, steps, table=self._table, window=self.decoder.context.mem_len,
                               device=self.device, dtype=self.dtype)
            how = "captured as CUDA graphs" if capture else "not captured (no CUDA)"
            self.steps = f"generation steps: the static-buffer decode step, {how}, one per batch bucket" + (
                f", compiled ({backend})" if backend else "")
        else:
            reason = why or ("--serve.graphs off" if graphs == "off" else "no CUDA device")
            self.steps = f"generation steps: {'compiled' if compile else 'eager'}, not captured ({reason})"
        # self.steps: what runs the generation steps, in one line (the server logs it at start-up)
        # Without same_length, a token the generation samples inside the session's unfinished segment sees what
        # reading it would show it: the boundary's memory and the tokens since, causally, at the same distances
        # (clamp_len alike). Its log-prob and its hidden states are then the reading's (Engine.read_ids).
        self.generation_reads_alike = not context.same_length

    def _table(self, need: int, model) -> tuple[torch.Tensor, ...]:
        """The positional table for ``need`` distances (grown in the decoder, which its eager steps share)."""
        d = self.decoder
        d.table = model.encoding.grow_table([layer.attn for layer in model.layers], d.table, need,
                                            d.context.clamp_len, d_model=model.config.d_model, dtype=self.dtype,
                                            device=self.device)
        return d.table

    @torch.no_grad()
    def run(self, kind: str, units: list[Unit]) -> list[Result]:
        if self.cmem_len:
            return self._run_compressive(kind, units)
        if kind == "step" and self.slots is not None:
            return self._run_slots(units)
        T = len(units[0].inputs)
        x = self._inputs(units)  # (B, T)
        if kind == "score":
            rows = self.decoder.rows([(u.memory, None) for u in units], cached=False)  # left-padded memories
            y = torch.tensor([u.labels for u in units], dtype=torch.long, device=self.device)  # (B, T)
            lp, out = read(self.model, x, y, rows.memory or None, context=self.read_ctx,
                           padding=rows.padding(T, device=self.device))
            k = max(u.top for u in units)
            if k:  # the alternatives at every position: the whole distribution of the same hidden states
                B, d = out.hidden.size(0), out.hidden.size(-1)
                log_probs = self.model.softmax.log_prob(out.hidden.reshape(B * T, d)).float()  # (B * T, V)
                values, ids = log_probs.view(B, T, -1).topk(k, dim=-1)  # (B, T, k) each
                values, ids = values.cpu().tolist(), ids.cpu().tolist()
            new = torch.stack(out.memory)  # (L, B, M', d)
            results = []
            for b, u in enumerate(units):
                real = (0 if u.memory is None else u.memory.size(1)) + T  # this row's rows: memory and segment
                keep = min(self.mem_len, real)  # the newest mem_len of them
                mem = new[:, b, new.size(2) - keep:].clone() if keep and u.with_memory else None
                top = [(i[:u.top], v[:u.top]) for i, v in zip(ids[b], values[b])] if u.top else None
                results.append(Result(logprobs=lp[b].tolist(), memory=mem, top=top))
            return results
        next_lp, new = self.decoder.run(x, self._rows(kind, units))  # (B, V) on the device
        return self._drawn(units, next_lp, [(new, b) for b in range(len(units))])

    def _run_slots(self, units: list[Unit]) -> list[Result]:
        """Step ``units`` in the preallocated slots (``Slots.step``): a row that stepped last round is there already;
        another (just prefilled, kept in its session, or out of the slots a while) is seated first."""
        seats, parts = [], []
        for u in units:
            if u.row is not None and isinstance(u.row[0], Seat) and u.row[0].slots is self.slots:
                seat = u.row[0]
                part = seat.saved  # None while seated
            else:
                seat = Seat(self.slots)
                part = u.row[0].take(u.row[1]) if u.row is not None else (u.memory, u.kv)
                if part[0] is None:  # nothing read yet: no rows
                    part = (torch.zeros(self.n_layer, 0, self.d_model, device=self.device, dtype=self.dtype), None)
            seats.append(seat)
            parts.append(part)
        log_probs, greedy = self.slots.step(seats, parts, self._inputs(units))  # (B, V), (B,)
        return self._drawn(units, log_probs, [(s, 0) for s in seats], greedy)

    def _inputs(self, units: list[Unit]) -> torch.Tensor:
        """The units' (B, T) input ids on the device: a step's from the tokens the last step drew there (one
        gather when only some of its rows go on), else copied from the host."""
        first = units[0].after
        if first is not None and all(u.after is not None and u.after[0] is first[0] for u in units):
            idx = [u.after[1] for u in units]
            tokens = first[0].tokens  # (B',)
            if idx != list(range(len(first[0]))):
                tokens = tokens.index_select(0, torch.tensor(idx, device=tokens.device))  # (B,)
            return tokens[:, None]  # (B, 1)
        if any(u.after is not None for u in units):  # rows of several batches: each token where it was drawn
            return torch.cat([u.after[0].tokens[u.after[1]:u.after[1] + 1] if u.after is not None else
                              torch.tensor(u.inputs, dtype=torch.long, device=self.device) for u in units])[:, None]
        return torch.tensor([u.inputs for u in units], dtype=torch.long, device=self.device)  # (B, T)

    @staticmethod
    def _drawn(units: list[Unit], next_lp: torch.Tensor, rows: list, greedy: torch.Tensor | None = None
               ) -> list[Result]:
        """The results of a generation unit group: each row's next log-probs (B, V) and its row, and, when the units
        carry their samplers, the tokens drawn on the device."""
        picks = [u.pick for u in units]
        drawn = None
        if any(p is not None for p in picks):
            if any(p is None for p in picks):
                raise ValueError("a generation unit group mixes units with and without a sampler (Unit.pick)")
            drawn = draw(next_lp, picks, greedy)
        return [Result(next_log_probs=next_lp[b], row=row, drawn=None if drawn is None else (drawn, b))
                for b, row in enumerate(rows)]

    def _rows(self, kind: str, units: list[Unit]) -> Rows:
        """The batch a generation unit group runs on: prefill's memories, one batch's rows as they are (or a
        subset of them), or rows of several batches (or kept in sessions) gathered into one, once."""
        if kind == "step" and units[0].row is not None:
            first = units[0].row[0]
            if all(u.row is not None and u.row[0] is first for u in units):
                idx = [u.row[1] for u in units]
                return first if idx == list(range(first.size)) else first.select(idx)
        return self.decoder.rows([u.row[0].take(u.row[1]) if u.row is not None else (u.memory, u.kv)
                                  for u in units])

    # -- a compressive model: both memories, rows of equal lengths batched -------------------------------------
    def take(self, row: tuple[Rows, int]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A generation row's memory (L, m, d) and keys, values (``Rows.take``; a compressive model's rows hold its
        state, the L memories then the L compressed ones: the memory alone, and the keys and values of its window
        [compressed; memory] (L, C + m, H, D) each, None without)."""
        rows, b = row
        if not self.cmem_len:
            return rows.take(b)
        kv = (torch.stack([k[b] for k in rows.keys]), torch.stack([v[b] for v in rows.values])
              ) if rows.keys and rows.version == self.decoder.version else None
        return torch.stack([m[b] for m in rows.memory[:self.n_layer]]), kv  # (L, m, d)

    def _state_of(self, u: Unit) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple | None]:
        """A compressive unit's (memory (L, m, d), compressed (L, C, d), its window's keys and values or None),
        memory and compressed None when empty."""
        if u.row is None:
            return u.memory, u.compressed, u.kv
        (rows, b), L = u.row, self.n_layer
        if not rows.memory:
            return None, None, None
        memory, kv = self.take(u.row)
        return memory, torch.stack([m[b] for m in rows.memory[L:]]), kv  # (L, m, d), (L, C, d)

    def _run_compressive(self, kind: str, units: list[Unit]) -> list[Result]:
        """``run`` for a compressive model: the units' rows grouped by (memory, compressed) lengths, one forward
        per group without padding (the model refuses pads: they would be compressed with the real rows)."""
        results: list[Result | None] = [None] * len(units)
        if kind == "step" and units[0].row is not None:
            first = units[0].row[0]
            if all(u.row is not None and u.row[0] is first for u in units):  # one batch's rows: stepped as they are
                idx = [u.row[1] for u in units]
                rows = first if idx == list(range(first.size)) else first.select(idx)  # no pads: a plain select
                return self._generate(units, rows)
        groups: dict[tuple, list[int]] = {}
        states = [self._state_of(u) for u in units]
        for i, (mem, cmem, _) in enumerate(states):
            lengths = (0 if mem is None else mem.size(1), 0 if cmem is None else cmem.size(1))
            groups.setdefault(lengths, []).append(i)
        for (m, _), idx in groups.items():
            state, keys, values = None, (), ()
            if m and all(states[i][2] is not None for i in idx):  # every row's window keys: (L, B, C + m, H, D) each
                keys, values = (tuple(torch.stack([states[i][2][j] for i in idx], 1).to(self.device, self.dtype)
                                      .unbind(0)) for j in (0, 1))
            if m:  # (L, B, m, d) and (L, B, C, d) -> the model's 2L tensors (B, m, d) then (B, C, d)
                mem = torch.stack([states[i][0] for i in idx], 1).to(self.device, self.dtype)
                cmem = torch.stack([states[i][1] if states[i][1] is not None else mem.new_zeros(mem.size(0), 0,
                                    mem.size(-1)) for i in idx], 1).to(self.device, self.dtype)
                state = (*mem.unbind(0), *cmem.unbind(0))
            group = [units[i] for i in idx]
            if kind == "score":
                out = self._score(group, state)
            else:
                out = self._generate(group, Rows(state or (), keys, values, [0] * len(idx),
                                                 version=self.decoder.version if keys else None))
            for i, r in zip(idx, out):
                results[i] = r
        return results  # type: ignore[return-value]

    def _generate(self, units: list[Unit], rows: Rows) -> list[Result]:
        """Prefill or step ``units`` after ``rows`` (no pads) through the decoder: the rows it returns hold the
        model's state (every token read kept uncompressed) and the keys and values of its window."""
        next_lp, new = self.decoder.run(self._inputs(units), rows)  # (B, V) on the device
        return self._drawn(units, next_lp, [(new, b) for b in range(len(units))])

    def _score(self, units: list[Unit], state) -> list[Result]:
        """Read one group of score units of equal state lengths as `txl score` reads: both memories after it are
        the model's own (it keeps mem_len to mem_len + c - 1 rows and compresses whole groups of c)."""
        T, L = len(units[0].inputs), self.n_layer
        x = torch.tensor([u.inputs for u in units], dtype=torch.long, device=self.device)  # (B, T)
        y = torch.tensor([u.labels for u in units], dtype=torch.long, device=self.device)  # (B, T)
        lp, out = read(self.model, x, y, state, context=self.read_ctx)
        k = max(u.top for u in units)
        if k:
            B, d = out.hidden.shape[0], out.hidden.shape[-1]
            log_probs = self.model.softmax.log_prob(out.hidden.reshape(B * T, d)).float()  # (B * T, V)
            values, ids = log_probs.view(B, T, -1).topk(k, dim=-1)  # (B, T, k) each
            values, ids = values.cpu().tolist(), ids.cpu().tolist()
        results = []
        for b, u in enumerate(units):
            mem = cmem = None
            if u.with_memory:
                mem = torch.stack([m[b] for m in out.memory[:L]])  # (L, m', d)
                cmem = torch.stack([m[b] for m in out.memory[L:]])  # (L, C', d)
                cmem = cmem if cmem.size(1) else None
            top = [(i[:u.top], v[:u.top]) for i, v in zip(ids[b], values[b])] if u.top else None
            results.append(Result(logprobs=lp[b].tolist(), memory=mem, compressed=cmem, top=top))
        return results
