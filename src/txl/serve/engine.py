"""The engine: the scheduler's worker running the request logic on the model runner, and the session store.

Three parts, each a module of its own:

* ``txl.serve.runner``: the model runner (``Model``): the batched forward passes of units of model work (read a
  segment, start a generation, one generation step), the rows a generation keeps between its steps, the tokens
  drawn on the device; on CUDA its steps run in preallocated slots (``txl.serve.slots``), each batch bucket's step
  captured as a CUDA graph (``txl.captured_step``);
* ``txl.serve.scheduler``: the worker thread and its queue (``Scheduler``, ``Job``): at most one active job per
  session, the units of the active jobs grouped by kind and length, the group ready longest run first;
* ``txl.serve.requests``: what a request does to its session (``Requests``: read text, generate), as generators
  of units.

``Engine`` joins them, and holds the one thing none of them owns: the session store (``SessionStore``), which the
worker alone touches. A job's session comes out of the store when the job becomes active and goes back into it
(written on a writer thread when durability is 'request') when the job ends.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from txl.serve.requests import Kept, Requests
from txl.serve.runner import Model, Result, Unit
from txl.serve.scheduler import Job, QueueFull, Scheduler, Work
from txl.serve.session import ClientError, SessionState, SessionStore

__all__ = ["Engine", "Job", "Kept", "Model", "QueueFull", "Result", "Unit", "Work"]

logger = logging.getLogger(__name__)


class Engine(Requests, Scheduler):
    """The worker thread, the session store it alone touches, and the queue in front of them."""

    def __init__(self, model: Model, tokenizer, store: SessionStore, *, max_queue: int, max_batch: int,
                 durable: bool, metrics=None, threads: int = 0, pipelined: bool | None = None) -> None:
        """``pipelined``: a generation launches its next step before the host reads this step's token
        (``Requests.generate``). None: where launches are asynchronous (CUDA), so that the device works while the
        host reads; on the CPU a launch runs to its end before it returns, so the order gains nothing there and
        would cost a request ended by a stop rule one extra step. tests/test_serve_pipelined.py runs both orders
        on the CPU."""
        super().__init__(model.run, max_queue=max_queue, max_batch=max_batch, metrics=metrics, threads=threads)
        self.m, self.tokenizer, self.store, self.durable = model, tokenizer, store, durable
        self.pipelined = model.device.type == "cuda" if pipelined is None else pipelined
        # Durable writes (write, fsync, rename, fsync the directory) run on threads of their own: the sessions of a
        # batch are written at once (their fsyncs wait on the disk together, not one after another) while the
        # worker runs the next forward. A session stays active until its write returns, so nothing else touches
        # it meanwhile and its next request starts after; the reply waits for the write ('request' durability).
        self.writer = ThreadPoolExecutor(max(1, min(max_batch, 8)), "txl-serve-write") if durable else None
        self.written: queue.SimpleQueue[tuple[Job, Any, Exception | None, float]] = queue.SimpleQueue()
        self.context_ids = [] if tokenizer.context_id is None else [int(tokenizer.context_id)]
        self._last_sweep = 0.0

    def stop(self, timeout: float) -> None:
        """Finish the jobs in flight (within ``timeout`` s), then write every changed session."""
        busy = self.stop_worker(timeout)
        if self.writer is not None:
            self.writer.shutdown(wait=True)
        if busy:
            logger.error("the worker did not stop: %d sessions in use are not written", len(busy))
        n = self.store.flush(exclude=busy)
        logger.info("sessions written: %d", n)

    # -- sessions out of the store and back ------------------------------------------------------------------
    def _admit(self) -> None:
        super()._admit()
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
            self._start(job, state)
        except Exception as err:  # noqa: BLE001 - reported to the request, never kills the worker
            self._fail(job, err)

    def _finish(self, job: Job, value: Any) -> None:
        job.unit = None
        if job.changes and job.state is not None and job.state.id and not job.delete:
            self.store.changed(job.state, durable=False)
            if self.writer is not None:  # replied to once written (_complete_writes)
                self.writer.submit(self._write, job, value)
                return
        super()._finish(job, value)

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
            Scheduler._finish(self, job, value)

    def _housekeeping(self) -> None:
        """Once a loop: sessions past their time to live expire; the gauges."""
        now = time.time()
        if now - self._last_sweep > min(60.0, self.store.ttl / 4):
            self._last_sweep = now
            busy = set(self.active) | set(self.queues)
            n = self.store.expire(now, busy)
            if n:
                logger.info("sessions expired: %d", n)
        if self.metrics is not None:
            self.metrics.sessions_in_memory.set(len(self.store.ram))
            self.metrics.sessions_on_disk.set(self.store.on_disk)
            self.metrics.queue_depth.set(self.waiting)
