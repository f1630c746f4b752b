"""The engine: one worker thread that runs every request's model work, batching sessions together.

Shape legend: B rows (sessions) in a batch, T tokens per row, L layers, m a row's memory rows, M the
longest (rows are left-padded to it), d d_model, H heads, D head width, V vocabulary.

A request is a job: a generator that yields units of model work (read a segment, start a generation,
one generation step) and receives their results. The worker keeps at most one job per session active,
the others queued in arrival order, so the requests of one session run in order and never interleave.
Each round it takes the units of the active jobs, groups those of the same kind and length, and runs a
group as one forward pass (dynamic batching): rows with shorter memories are left-padded and the pads
masked as keys (``padding=`` of the model's forward), which relative attention does not notice, so a
row computes what it would alone (a test proves it).

A generation's rows stay batched between its steps (``Rows``): a step whose rows all come from one batch
steps that batch's tensors as they are (or the subset still running, one index_select per tensor), so the
per-step cost does not grow with copying every row's memory and keys/values in and out; rows from different
batches (a generation joining others) are gathered once into a new batch.

Reading uses the session's context (segment_len, mem_len, same_length, clamp_len: as `txl score`, through
``txl.decoding.read``). Generation continues from the memory as `txl generate` does, with its units, sampler
and stop-text matcher (``txl.decoding``: same_length off, the memory growing with the tokens generated, keys
and values cached, rows on the model's device); what it generates is then read into the session like text.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from txl.compiled_step import compiled_step_error
from txl.config import Context
from txl.data.tokenizer.stream import TextStream
from txl.decoding import Decoder, Picker, Rows, StopText, read
from txl.serve.session import ClientError, SessionState, SessionStore, take_text

logger = logging.getLogger(__name__)


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

    @property
    def key(self) -> tuple[str, int]:
        return self.kind, len(self.inputs)


@dataclass
class Kept:
    """A generation's rows kept in its session (``SessionState.generation``) for the generation that follows."""

    memory: torch.Tensor
    """(L, m, d): the session's memory rows, then every token the generation read."""
    kv: tuple[torch.Tensor, torch.Tensor] | None
    """Their keys and values (L, m, H, D) each (None without a cache)."""
    inputs: int
    """How many of the session's tokens the rows read (m less the memory's rows)."""
    session_memory: torch.Tensor | None
    """The session's memory they started from (the same object: no segment ended since)."""
    n_tokens: int
    """The session's token count then (anything read since makes the rows stale)."""


@dataclass
class Result:
    logprobs: list[float] | None = None
    """'score': log p(labels[t]) for each t."""
    next_log_probs: torch.Tensor | None = None
    """'prefill' and 'step': (V,) log-probabilities of the next token."""
    memory: torch.Tensor | None = None
    """'score': the row's new memory (L, m', d)."""
    compressed: torch.Tensor | None = None
    """'score', a compressive model: the row's new compressed memory (L, C', d)."""
    row: tuple[Rows, int] | None = None
    """'prefill' and 'step': the row in the generation batch (``Rows.take`` gives its memory, keys, values)."""
    top: list[tuple[list[int], list[float]]] | None = None
    """'score' with ``Unit.top``: at each position, the most likely next tokens' ids and log-probs."""


class Model:
    """The model and the batched forward passes of the three kinds of unit: 'score' through
    ``txl.decoding.read`` (as `txl score` reads), 'prefill' and 'step' through ``txl.decoding.Decoder.run``
    (as `txl generate` generates)."""

    def __init__(self, model, *, segment_len: int, context: Context | None = None, mem_len: int | None = None,
                 same_length: bool | None = None, clamp_len: int | None = None, compile: bool = False) -> None:
        """``context``: the reading context (``ServeConfig.context``); or its fields, None being the model's.
        ``compile``: generation steps through one compiled graph (``Decoder``'s ``compile``)."""
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
        if compile and (why := compiled_step_error(model)) is not None:
            raise ValueError(f"serve.compile: {why}; serve this model without --serve.compile")
        self.decoder = Decoder(model, clamp_len=context.clamp_len, check_weights=False, compile=compile)
        self.device, self.dtype = self.decoder.device, self.decoder.dtype
        # Without same_length, a token the generation samples inside the session's unfinished segment sees what
        # reading it would show it: the boundary's memory and the tokens since, causally, at the same distances
        # (clamp_len alike). Its log-prob and its hidden states are then the reading's (Engine.read_ids).
        self.generation_reads_alike = not context.same_length

    @torch.no_grad()
    def run(self, kind: str, units: list[Unit]) -> list[Result]:
        if self.cmem_len:
            return self._run_compressive(kind, units)
        T = len(units[0].inputs)
        x = torch.tensor([u.inputs for u in units], dtype=torch.long, device=self.device)  # (B, T)
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
        next_lp, new = self.decoder.run(x, self._rows(kind, units))
        next_lp = next_lp.cpu()  # (B, V): sampled on the host
        return [Result(next_log_probs=next_lp[b], row=(new, b)) for b in range(len(units))]

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
        x = torch.tensor([u.inputs for u in units], dtype=torch.long, device=self.device)  # (B, T)
        next_lp, new = self.decoder.run(x, rows)
        next_lp = next_lp.cpu()  # (B, V)
        return [Result(next_log_probs=next_lp[b], row=(new, b)) for b in range(len(units))]

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


# -- jobs ------------------------------------------------------------------------------------------------

Work = Generator[Unit, Result, Any]


@dataclass
class Job:
    """One request: ``work(state)`` is a generator of units; ``emit(event, data)`` reports to the request."""

    session: str | None
    """The session it works on (None: a temporary one, e.g. a completion without ``session``)."""
    owner: str
    work: Callable[[SessionState, Job], Work | Any]
    """(state, this job) -> a generator of units returning the result, or the result itself."""
    emit: Callable[[str, Any], None]
    changes: bool = True
    """Whether it changes the session (and so is written when durability is 'request')."""
    create: dict | None = None
    """Create the session first (with these options: with_memory)."""
    delete: bool = False
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    ready: float = 0.0
    """When its current unit became ready (monotonic; its first: when submitted): the group of the unit ready
    longest runs first."""
    key: str = ""
    gen: Work | None = None
    unit: Unit | None = None
    state: SessionState | None = None


class QueueFull(Exception):
    pass


class Engine:
    """The worker thread, the session store it alone touches, and the queue in front of them."""

    def __init__(self, model: Model, tokenizer, store: SessionStore, *, max_queue: int, max_batch: int,
                 durable: bool, metrics=None, threads: int = 0) -> None:
        self.m, self.tokenizer, self.store = model, tokenizer, store
        self.max_queue, self.max_batch, self.durable = max_queue, max_batch, durable
        self.metrics, self.threads = metrics, threads
        self.incoming: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.waiting = 0  # jobs submitted and not yet active
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict[str, deque[Job]] = {}
        self.active: dict[str, Job] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="txl-serve-engine", daemon=True)
        # Durable writes (write, fsync, rename, fsync the directory) run on threads of their own: the sessions of a
        # batch are written at once (their fsyncs wait on the disk together, not one after another) while the
        # worker runs the next forward. A session stays active until its write returns, so nothing else touches
        # it meanwhile and its next request starts after; the reply waits for the write ('request' durability).
        self.writer = ThreadPoolExecutor(max(1, min(max_batch, 8)), "txl-serve-write") if durable else None
        self.written: queue.SimpleQueue[tuple[Job, Any, Exception | None, float]] = queue.SimpleQueue()
        self._temp = 0
        self._failure: str | None = None
        self.context_ids = [] if tokenizer.context_id is None else [int(tokenizer.context_id)]

    # -- the request side (any thread) ------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    @property
    def failure(self) -> str | None:
        """Why the worker stopped when it should be running (None while it runs, or before ``start``)."""
        if self._failure is not None:
            return self._failure
        if self.thread.ident is None or self.thread.is_alive() or self.stopping:
            return None
        return "the model worker stopped"

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.stopping:
                raise ClientError(503, None, "the server is shutting down")
            if self.failure is not None:
                raise ClientError(503, None, "the model worker stopped on an internal error (see the server's log); "
                                  "restart the server")
            if self.waiting >= self.max_queue:
                raise QueueFull
            self.waiting += 1
            self._temp += 1
            job.key = job.session or f"~{self._temp}"
            self.incoming.put(job)
        self.wake.set()

    def stop(self, timeout: float) -> None:
        """Finish the jobs in flight (within ``timeout`` s), then write every changed session."""
        with self.lock:
            self.stopping = True
        self.wake.set()
        self.thread.join(timeout)
        if self.thread.is_alive():  # generations stop at their next token, reading at its next segment
            logger.warning("requests still running after %.0f s of draining: generations cut short", timeout)
            for job in list(self.active.values()):
                job.cancelled = True
            self.thread.join(timeout)
        busy = set(self.active) if self.thread.is_alive() else set()
        if self.writer is not None:
            self.writer.shutdown(wait=True)
        if busy:
            logger.error("the worker did not stop: %d sessions in use are not written", len(busy))
        n = self.store.flush(exclude=busy)
        logger.info("sessions written: %d", n)

    @property
    def queue_depth(self) -> int:
        return self.waiting

    # -- the worker --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # an error no request caused: the requests get 503, /health says so
            with self.lock:  # no job is submitted after this (submit checks it under the lock)
                self._failure = f"the model worker stopped on {type(err).__name__} (see the server's log)"
            logger.exception("the model worker stopped; every model request now answers 503", exc_info=err)
            down = ClientError(503, None, "the model worker stopped on an internal error (see the server's log); "
                               "restart the server")
            jobs = list(self.active.values()) + [j for q in self.queues.values() for j in q]
            while True:
                try:
                    jobs.append(self.incoming.get_nowait())
                except queue.Empty:
                    break
            for job in jobs:
                job.emit("error", down)

    def _serve(self) -> None:
        # OpenMP's thread count is per thread: a new thread starts with OMP_NUM_THREADS (else every core), whatever
        # torch.set_num_threads said in the main thread. Set it here, or a server started without OMP_NUM_THREADS
        # computes with every core (other bits, and ~20x slower beside a busy process) while one started with
        # OMP_NUM_THREADS=1 uses one.
        torch.set_num_threads(self.threads or torch.get_num_threads())
        last_sweep = 0.0
        while True:
            self._complete_writes()
            self._admit()
            if not self.active:
                with self.lock:
                    done = self.stopping and self.waiting == 0 and self.incoming.empty()
                if done:
                    return
                self.wake.wait(0.2)
                self.wake.clear()
            elif not self._round():  # every active request waits for its write
                self.wake.wait(0.2)
                self.wake.clear()
            now = time.time()
            if now - last_sweep > min(60.0, self.store.ttl / 4):
                last_sweep = now
                busy = set(self.active) | set(self.queues)
                n = self.store.expire(now, busy)
                if n:
                    logger.info("sessions expired: %d", n)
            self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.sessions_in_memory.set(len(self.store.ram))
            self.metrics.sessions_on_disk.set(self.store.on_disk)
            self.metrics.queue_depth.set(self.waiting)

    def _admit(self) -> None:
        while True:
            try:
                job = self.incoming.get_nowait()
            except queue.Empty:
                break
            self.queues.setdefault(job.key, deque()).append(job)
        for key in list(self.queues):
            if key in self.active:
                continue
            q = self.queues[key]
            job = q.popleft()
            if not q:
                del self.queues[key]
            with self.lock:
                self.waiting -= 1
            self.active[key] = job
            self._begin(job)
        evicted = self.store.evict(set(self.active) | set(self.queues))
        if evicted and self.metrics is not None:
            self.metrics.evictions.inc(evicted)

    def _begin(self, job: Job) -> None:
        try:
            if job.create is not None:
                state = self.store.create(job.owner, context=self.context_ids, **job.create)
            elif job.session is None:
                state = SessionState(id="", owner=job.owner, tokens=list(self.context_ids))
            else:
                state = self.store.get(job.session, job.owner)
            job.state = state
            if job.changes and state.id:
                state.requests += 1  # its place in the session's order, reported with its reply
            if job.delete:
                self.store.delete(state.id)
                self._finish(job, job.work(state, job))
                return
            job.gen = job.work(state, job)
            if not isinstance(job.gen, Generator):
                self._finish(job, job.gen)
                return
            job.unit, job.ready = next(job.gen), job.submitted
        except StopIteration as stop:
            self._finish(job, stop.value)
        except Exception as err:  # noqa: BLE001 - reported to the request, never kills the worker
            self._fail(job, err)

    def _round(self) -> bool:
        """Run one batched forward; False when no active request has a unit ready."""
        groups: dict[tuple[str, int], list[Job]] = {}
        for job in self.active.values():
            if job.unit is not None:
                groups.setdefault(job.unit.key, []).append(job)
        if not groups:
            return False
        # The group holding the unit that has been ready longest goes first; up to max_batch rows of it. Ready,
        # not submitted: a generation's next step is ready after the step before, so a request that arrived
        # meanwhile has its prefill run next and its steps join the others' batch (continuous batching),
        # instead of waiting for every step of the older generations.
        key = min(groups, key=lambda k: min((j.ready, j.submitted) for j in groups[k]))
        jobs = sorted(groups[key], key=lambda j: (j.ready, j.submitted))[:self.max_batch]
        start = time.perf_counter()
        try:
            results = self.m.run(key[0], [j.unit for j in jobs])
        except Exception as err:  # noqa: BLE001
            for job in jobs:
                self._fail(job, err)
            return True
        if self.metrics is not None:
            self.metrics.forward_seconds.labels(key[0]).observe(time.perf_counter() - start)
            self.metrics.batch_rows.observe(len(jobs))
        for job, result in zip(jobs, results):
            try:
                job.unit, job.ready = job.gen.send(result), time.monotonic()
            except StopIteration as stop:
                self._finish(job, stop.value)
            except Exception as err:  # noqa: BLE001
                self._fail(job, err)
        return True

    def _finish(self, job: Job, value: Any) -> None:
        job.unit = None
        if job.changes and job.state is not None and job.state.id and not job.delete:
            self.store.changed(job.state, durable=False)
            if self.writer is not None:  # replied to once written (_complete_writes)
                self.writer.submit(self._write, job, value)
                return
        self.active.pop(job.key, None)
        job.emit("done", value)

    def _write(self, job: Job, value: Any) -> None:
        """On a writer thread: the session's file, then hand the request back to the worker."""
        start, error = time.perf_counter(), None
        try:
            self.store.write(job.state)
        except Exception as err:  # noqa: BLE001 - whatever failed, the request is answered and the session freed
            error = err
        self.written.put((job, value, error, time.perf_counter() - start))
        self.wake.set()

    def _complete_writes(self) -> None:
        while True:
            try:
                job, value, error, seconds = self.written.get_nowait()
            except queue.Empty:
                return
            if error is not None:  # the session stays changed (dirty): written again at eviction or exit
                if not isinstance(error, OSError):
                    self._fail(job, error)  # logged with its traceback: a 500
                    continue
                logger.error("could not write session %s to %s (%s); it stays in memory with this request's change",
                             job.state.id, self.store.dir, error.strerror or error)
                self._fail(job, ClientError(507, None, "the request was done but the session's state could not be "
                                            "written (the server's disk is full?); the session keeps the change in "
                                            "memory and is written again with its next request"))
                continue
            self.store.dirty.discard(job.state.id)
            if self.metrics is not None:
                self.metrics.write_seconds.observe(seconds)
            self.active.pop(job.key, None)
            job.emit("done", value)

    def _fail(self, job: Job, err: Exception) -> None:
        self.active.pop(job.key, None)
        if not isinstance(err, ClientError):
            logger.exception("request failed", exc_info=err)
        job.emit("error", err)

    # -- the work of requests (generators run by the worker) ----------------------------------------------
    def read_ids(self, state: SessionState, ids: list[int], generated: tuple[list[float], Result] | None = None,
                 *, top: int = 0, tops: list | None = None) -> Generator[Unit, Result, list[float]]:
        """Read ``ids`` into the session; the log-probs of those that are scored (all but a document's first
        token when there is no context token).

        ``generated``: ``ids`` were just sampled from the session by ``generate``, which gives their log-probs and
        its last result (its batch row holds the hidden states of every token it read). Where the reading
        context equals the generation's (``Model.generation_reads_alike``), the tokens up to the end of the
        unfinished segment are not read again: their log-probs are the generation's, and the memory at the
        segment's end (when they complete it) is the generation's rows up to there. Tokens past that boundary
        are read (the generation showed them more than the reading's memory).

        ``top``: the ``top`` most likely tokens at each scored position are appended to ``tops`` (ids, log-probs),
        one entry per log-prob returned (a completion's echoed prompt; not with ``generated``).
        """
        S = self.m.segment_len
        state.generation = None  # what is read now was not read by the last generation
        toks = state.tokens + ids
        offset = len(state.tokens)  # toks[offset:] are new; label j is toks[j + 1]
        out: list[float] = []
        unfinished = True  # the unfinished segment is read again from the boundary
        if generated is not None and self.m.generation_reads_alike and offset:
            known, last = generated
            if len(toks) - 1 < S:  # all in the unfinished segment: nothing to compute
                out, unfinished = list(known), False
            elif self.m.cmem_len:  # a compressive model compresses at the boundary: the segment is read again
                pass
            else:  # the segment completes: its memory from the generation's rows, as its reading would keep it
                rows, b = last.row
                memory, _ = rows.take(b)  # (L, m, d): the memory rows, then every token the generation read
                end = (0 if state.memory is None else state.memory.size(1)) + S
                keep = min(self.m.mem_len, end)
                state.memory = memory[:, end - keep:end].clone() if keep and state.with_memory else None
                out = list(known[:S - offset + 1])  # labels toks[offset..S]
                toks, offset = toks[S:], 0
        while len(toks) - 1 >= S:  # a complete segment: S labels, its memory kept
            r = yield Unit("score", toks[:S], state.memory, toks[1:S + 1], with_memory=state.with_memory, top=top,
                           compressed=state.compressed)
            out.extend(r.logprobs[max(offset - 1, 0):])
            if top:
                tops.extend(r.top[max(offset - 1, 0):])
            state.memory, state.compressed = r.memory, r.compressed
            toks, offset = toks[S:], max(offset - S, 0)
        first = max(offset - 1, 0)
        if unfinished and len(toks) >= 2 and first <= len(toks) - 2:  # read again from the boundary
            r = yield Unit("score", toks[:-1], state.memory, toks[1:], with_memory=state.with_memory, top=top,
                           compressed=state.compressed)
            out.extend(r.logprobs[first:])
            if top:
                tops.extend(r.top[first:])
        state.tokens = toks
        state.n_tokens += len(ids)
        state.n_scored += len(out)
        state.nll -= sum(out)
        if self.metrics is not None:
            self.metrics.tokens_read.inc(len(ids))
        return out

    def read_text(self, state: SessionState, data: str | bytes, *, final: bool, top: int = 0,
                  tops: list | None = None) -> Generator[Unit, Result, tuple[list[int], list[float]]]:
        ids, text, tail, raw = take_text(state, data, self.tokenizer, final=final)
        lps = yield from self.read_ids(state, ids, top=top, tops=tops)
        state.tail, state.raw = tail, raw
        state.chars += len(text)
        return ids, lps

    def read_tail(self, state: SessionState, *, top: int = 0,
                  tops: list | None = None) -> Generator[Unit, Result, tuple[list[int], list[float]]]:
        """Read the session's unfinished line as it stands (a prompt's end, or the text a generation continues):
        its ids and the log-probs of those scored."""
        if state.raw:
            raise ClientError(400, "session", "the session holds an unfinished UTF-8 character: send its "
                              "remaining bytes first")
        if not state.tail:
            return [], []
        try:
            ids = [int(i) for i in self.tokenizer.encode_prompt(state.tail)]
        except ValueError as err:
            raise ClientError(400, "text", str(err)) from None
        state.chars += len(state.tail)
        state.tail = ""
        lps = yield from self.read_ids(state, ids, top=top, tops=tops)
        return ids, lps

    def read_prompt(self, state: SessionState, text: str, *, top: int = 0,
                    tops: list | None = None) -> Generator[Unit, Result, tuple[list[int], list[float]]]:
        """Read a completion's prompt: whole text, its last line (a word-level model's last word) read as it
        stands instead of held back for more text, as a session's text is (``top``, ``tops``: ``read_ids``')."""
        ids, lps = yield from self.read_text(state, text, final=False, top=top, tops=tops)
        more, more_lps = yield from self.read_tail(state, top=top, tops=tops)
        return ids + more, lps + more_lps

    def generate(self, state: SessionState, *, max_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: int | None, stop: list[str], job: Job, on_text: Callable[[str], None] | None = None,
                 top_logprobs: int = 0, repetition_penalty: float = 1.0, stop_tokens: Sequence[int] = (),
                 on_token: Callable[..., None] | None = None) -> Generator[Unit, Result, dict]:
        """Continue the session: sample up to ``max_tokens`` tokens, then read them into it. The text is what
        the tokens add to the session's text (for words: after a space, unless a line just ended).

        Tokens are chosen as `txl generate` chooses them (``txl.decoding.Picker``: a seed is row 0's, the
        repetition penalty counts the tokens since the session's last segment boundary, the memory's are not
        kept); ``stop`` texts are found by ``txl.decoding.StopText``, which holds back what may become one.
        ``on_token(id, log-prob, top alternatives, end)`` sees each token as it is drawn, before the text its push
        releases goes out (``end``: the length of the text then, held text included), and
        ``on_token(None, None, None, end)`` once the text stream has finished.
        """
        yield from self.read_tail(state)  # an unfinished line: generation continues it
        if not state.tokens:
            raise ClientError(400, "session", "the session has read no text yet: give a prompt or read some text "
                              "first (generation continues a text)")
        try:
            pick = Picker(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                          seeds=None if seed is None else [seed], stop_tokens=stop_tokens, top_logprobs=top_logprobs,
                          vocab_size=self.m.model.config.vocab_size)
        except ValueError as err:
            raise ClientError(400, "stop_token_ids", str(err)) from None
        pick.see(torch.tensor([state.tokens]))
        stream = TextStream(self.tokenizer, context=state.tokens)
        texts = StopText(stop)
        produced: list[int] = []
        chosen: list[float] = []
        tops: list[dict[str, float]] = []
        finish = "length"
        kept, start_memory = state.generation, state.memory
        if max_tokens:
            if (kept is not None and kept.session_memory is state.memory and kept.n_tokens == state.n_tokens
                    and kept.inputs == len(state.tokens) - 1):
                # The last generation's rows read every token but its last one, with the same memory and the same
                # context a prefill would give them: one step from them, batched with the others' steps.
                r = yield Unit("step", state.tokens[-1:], kept.memory, kv=kept.kv, compressed=state.compressed)
            else:
                r = yield Unit("prefill", state.tokens, state.memory, compressed=state.compressed)
        for i in range(max_tokens):
            if job.cancelled:
                finish = "cancelled"
                break
            step = pick(r.next_log_probs[None])  # (V,) -> one row
            token = int(step.tokens[0])
            produced.append(token)
            chosen.append(float(step.logprobs[0]))
            if step.top is not None:
                tops.append({self.tokenizer.token_text(t): v for t, v in step.top[0]})
            stopped = texts.push(stream.push(token))
            if on_token is not None:  # before its text goes out; ``end``: where the text pushed so far ends
                on_token(token, chosen[-1], tops[-1] if step.top is not None else {}, len(texts.text))
            if stopped or bool(step.stopped[0]):
                finish = "stop"
                break
            piece = texts.show()
            if piece and on_text is not None:
                on_text(piece)
            if i + 1 < max_tokens:
                r = yield Unit("step", [token], row=r.row)
        if not texts.stopped:  # the last token's text (a stop token's too)
            if texts.push(stream.finish()):
                finish = "stop"
        if on_token is not None and produced:  # the end of the last token's text, now that the stream is finished
            on_token(None, None, None, len(texts.text))
        piece = texts.finish()
        if piece and on_text is not None:
            on_text(piece)
        shown = texts.text
        if self.metrics is not None:
            self.metrics.tokens_generated.inc(len(produced))
        # What was generated becomes part of the session, read as text is (its scores as `txl score` gives).
        yield from self.read_ids(state, produced, (chosen, r) if produced else None)
        if produced and state.memory is start_memory:  # no segment ended: the rows stay valid for the next one
            memory, kv = self.m.take(r.row)  # (L, m, d), (L, m, H, D) each: this row's, copied out of the batch
            m0 = 0 if start_memory is None else start_memory.size(1)
            state.generation = Kept(memory, kv, memory.size(1) - m0, start_memory, state.n_tokens)
        state.generated += len(produced)
        state.chars += len(self.tokenizer.decode(produced)) if produced else 0
        return {"text": shown, "ids": produced, "logprobs": chosen, "top_logprobs": tops, "finish_reason": finish}
