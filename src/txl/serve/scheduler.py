"""The scheduler: one worker thread, the queue in front of it, and which rows step together.

A request is a job: a generator that yields units of model work (``txl.serve.runner.Unit``: read a segment, start
a generation, one generation step) and receives their results. The worker keeps at most one job per session
active, the others queued in arrival order, so the requests of one session run in order and never interleave.
Each round it takes the units of the active jobs, groups those of the same kind and length, and hands the group
whose unit has been ready longest (up to ``max_batch`` rows) to the model runner as one forward pass.

What a job's session is, and how it goes in and out of the durable store, is the engine's
(``txl.serve.engine.Engine`` fills in ``_begin`` and ``_finish``); this module knows jobs and units only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from txl.serve.runner import Result, Unit
from txl.serve.session import ClientError, SessionState

__all__ = ["Job", "QueueFull", "Scheduler", "Work"]

logger = logging.getLogger(__name__)

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


class Scheduler:
    """The worker thread and the queue in front of it. ``run(kind, units)``: the model runner's batched forward.

    A subclass says what a job's session is: ``_begin(job)`` makes the job active (its state, its first unit),
    ``_finish(job, value)`` ends it (``Scheduler._finish`` replies), ``_complete_writes()`` and ``_housekeeping()``
    run once a loop.
    """

    def __init__(self, run: Callable[[str, list[Unit]], list[Result]], *, max_queue: int, max_batch: int,
                 metrics=None, threads: int = 0) -> None:
        self.run = run
        self.max_queue, self.max_batch = max_queue, max_batch
        self.metrics, self.threads = metrics, threads
        self.incoming: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.waiting = 0  # jobs submitted and not yet active
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict[str, deque[Job]] = {}
        self.active: dict[str, Job] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="txl-serve-engine", daemon=True)
        self._temp = 0
        self._failure: str | None = None

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

    def stop_worker(self, timeout: float) -> set[str]:
        """Finish the jobs in flight (within ``timeout`` s); the sessions still in use if the worker did not stop."""
        with self.lock:
            self.stopping = True
        self.wake.set()
        self.thread.join(timeout)
        if self.thread.is_alive():  # generations stop at their next token, reading at its next segment
            logger.warning("requests still running after %.0f s of draining: generations cut short", timeout)
            for job in list(self.active.values()):
                job.cancelled = True
            self.thread.join(timeout)
        return set(self.active) if self.thread.is_alive() else set()

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
            self._housekeeping()

    def _admit(self) -> None:
        """Queue what arrived; make the first queued job of every session without an active one active."""
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
            results = self.run(key[0], [j.unit for j in jobs])
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

    def _start(self, job: Job, state: SessionState) -> None:
        """Run ``job`` on ``state`` up to its first unit (a job that is not a generator finishes at once)."""
        job.state = state
        try:
            job.gen = job.work(state, job)
            if not isinstance(job.gen, Generator):
                self._finish(job, job.gen)
                return
            job.unit, job.ready = next(job.gen), job.submitted
        except StopIteration as stop:
            self._finish(job, stop.value)

    def _finish(self, job: Job, value: Any) -> None:
        """Reply to ``job`` and free its session for the next."""
        job.unit = None
        self.active.pop(job.key, None)
        job.emit("done", value)

    def _fail(self, job: Job, err: Exception) -> None:
        self.active.pop(job.key, None)
        if not isinstance(err, ClientError):
            logger.exception("request failed", exc_info=err)
        job.emit("error", err)

    # -- what a subclass says about sessions ----------------------------------------------------------------
    def _begin(self, job: Job) -> None:
        raise NotImplementedError

    def _complete_writes(self) -> None:
        pass

    def _housekeeping(self) -> None:
        pass
