"""The serving logic between the routes and the engine: the app's state (config, engine once loaded,
metrics), a request's job submitted to the engine and awaited, and a streamed answer as server-sent events.

Nothing here knows HTTP routes or the OpenAI format; nothing here runs the model (the engine does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from txl.serve.config import ServeConfig
from txl.serve.engine import Engine, Job, Model, QueueFull
from txl.serve.metrics import Metrics
from txl.serve.responses import StreamError
from txl.serve.session import ID_PATTERN, ClientError, SessionStore, model_fingerprint

logger = logging.getLogger(__name__)


class Events:
    """What the worker reports for one request, handed over to the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def emit(self, kind: str, data: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, data))
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass


class Server:
    """The app's state: the config, the engine once the model is loaded, the metrics. No global state."""

    def __init__(self, config: ServeConfig, load: Callable[[], tuple[Any, Any, str]],
                 on_load_error: Callable[[Exception], None] | None = None) -> None:
        self.config, self.load, self.on_load_error = config, load, on_load_error
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.name = "txl"
        self.failed = False
        self.keys = config.keys

    def load_model(self) -> None:
        try:
            model, tokenizer, self.name = self.load()
            s = self.config
            self.name = s.model_name or self.name
            m = Model(model, segment_len=s.segment_len, context=s.context(model.config),  # resolved here, once
                      compile=s.compile, graphs=s.graphs)
            logger.info("%s", m.steps)  # which step generates: captured, compiled or eager, and why
            store = SessionStore(s.state_dir, max_in_memory=s.max_sessions_in_memory, ttl=s.session_ttl,
                                 model=model_fingerprint(model.config, tokenizer))
            engine = Engine(m, tokenizer, store, max_queue=s.max_queue, max_batch=s.max_batch,
                            durable=s.durability == "request", metrics=self.metrics, threads=s.threads)
            engine.start()
            self.engine = engine
            logger.info("model %s ready, reading with segment_len %d, %s, generation %s: %d sessions in %s",
                        self.name, s.segment_len, m.read_ctx.describe(),
                        "pipelined" if engine.pipelined else "reading each token before the next step",
                        len(store.last_used), s.state_dir)
        except Exception as err:  # noqa: BLE001 - the server stays up and says it failed
            self.failed = True
            logger.error("the model failed to load: %s", err)
            if self.on_load_error is not None:
                self.on_load_error(err)

    def ready(self) -> Engine:
        """The engine, or a 503 while the model loads (or after it failed to)."""
        if self.engine is None:
            reason = "the model failed to load (see the server's log)" if self.failed else "the model is loading"
            raise ClientError(503, None, reason)
        return self.engine

    def info(self, state) -> dict:
        m = self.engine.m
        return state.info(n_layer=m.n_layer, mem_len=m.mem_len, d_model=m.d_model, cmem_len=m.cmem_len,
                          cmem_rate=m.cmem_rate)

    async def run(self, session: str | None, owner: str, work, *, changes: bool = True, create: dict | None = None,
                  delete: bool = False, events: Events | None = None) -> Any:
        """Submit a job and wait for its result; with ``events``, return the job at once (its events, 'text'
        pieces then 'done' or 'error', go to ``events``' queue)."""
        engine = self.ready()
        if session is not None and not ID_PATTERN.match(session):
            raise ClientError(404, "session", "no such session (it was deleted, expired, or belongs to another key)")
        ev = events or Events()
        job = Job(session=session, owner=owner, work=work, emit=ev.emit, changes=changes, create=create, delete=delete)
        try:
            engine.submit(job)
        except QueueFull:
            raise ClientError(429, None, f"the queue is full (serve.max_queue={self.config.max_queue}); "
                              "retry shortly") from None
        if events is not None:
            return job
        while True:
            kind, data = await ev.queue.get()
            if kind == "done":
                return data
            if kind == "error":
                raise data


async def sse(events: Events, job: Job, render: Callable[[str, Any], dict | list[dict] | None],
              first: list | None = None, *, model: type[BaseModel]):
    """A streamed answer: an error before the first event is a plain JSON error; then server-sent events,
    ``data: {...}`` each (what ``render`` makes of an event, validated as a ``model``: the route's chunk model in
    ``txl.serve.responses``), ending with ``data: [DONE]``; a failure after the first (the generation's, or a chunk
    that is not its model) sends an error chunk (``StreamError``) before it. A client that goes away cancels the
    generation at the next token; what was generated stays in the session."""
    from fastapi.responses import StreamingResponse

    def data(chunk: dict, kind: type[BaseModel]) -> str:  # only the keys the chunk sets, as the JSON answers
        return f"data: {kind.model_validate(chunk).model_dump_json(exclude_unset=True)}\n\n"

    kind, value = await events.queue.get()
    if kind == "error":
        raise value

    def failed(err: BaseException) -> str:  # the last chunk of a stream that fails: a client error's words, else none
        err = err if isinstance(err, ClientError) else ClientError(500, None, "internal error")
        return data({"error": {"field": err.field, "reason": err.reason}}, StreamError)

    async def stream():
        nonlocal kind, value
        try:
            try:
                for k, d in first or []:
                    yield data(render(k, d), model)
                while True:
                    if kind == "error":
                        yield failed(value)
                        break
                    chunk = render(kind, value)
                    # None: an event that makes no chunk of its own (a token before its text); a list: several
                    for c in [] if chunk is None else chunk if isinstance(chunk, list) else [chunk]:
                        yield data(c, model)
                    if kind == "done":
                        break
                    kind, value = await events.queue.get()
            except Exception as err:
                # The 200 is sent: a chunk that cannot be made, or is not its model (a key it does not declare), ends
                # the stream as a failed generation does, not as a connection cut without its end.
                logger.exception("a streamed chunk failed; the stream ends with an error")
                yield failed(err)
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True  # no effect once it is done; stops the generation if the client left

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
