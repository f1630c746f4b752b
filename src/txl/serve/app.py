"""The HTTP surface of `txl serve`: FastAPI routes, errors as JSON, limits, keys, metrics, the access log.

Every client error is ``{"error": {"field", "reason", "message", "type", "param", "code"}}`` (the OpenAI
shape, with the field at fault and why): 400 for a bad value or malformed JSON, 422 for a wrong type or
an unknown field, 401 for a missing or wrong key, 404 for an unknown session (or another key's), 413 for
too large, 429 when the queue is full, 503 while the model loads. Nothing a client sends yields a 500,
and no error body holds a traceback or a server path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from txl.serve.config import ServeConfig
from txl.serve.engine import Engine, Job, Model, QueueFull
from txl.serve.metrics import Metrics
from txl.serve.session import ID_PATTERN, ClientError, SessionStore, owner_of

logger = logging.getLogger(__name__)
access_log = logging.getLogger("txl.serve.access")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "unavailable"}


def error_response(status: int, field: str | None, reason: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": f"{field}: {reason}" if field else reason, "type": _TYPES.get(status, "server_error"),
                      "param": field, "field": field, "reason": reason, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than serve.max_body_bytes={limit}")


# -- request bodies ---------------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Sampling(_Body):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class CompletionRequest(Sampling):
    prompt: str | list[str] = ""
    model: str | None = None
    logprobs: int | None = None
    echo: bool = False
    session: str | None = None
    n: int = 1
    best_of: int | None = None
    user: str | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream_options: dict[str, Any] | None = None


class GenerateRequest(Sampling):
    logprobs: bool = False


def _check_sampling(req: Sampling, limit: int) -> list[str]:
    """Range checks (400) after the types (422); returns the stop texts."""
    if req.max_tokens < 0:
        raise ClientError(400, "max_tokens", f"must be >= 0, got {req.max_tokens}")
    if req.max_tokens > limit:
        raise ClientError(400, "max_tokens", f"must be <= {limit} (serve.max_tokens), got {req.max_tokens}")
    if not req.temperature >= 0 or req.temperature == float("inf"):
        raise ClientError(400, "temperature", f"must be a finite number >= 0 (0: greedy), got {req.temperature}")
    if not 0 < req.top_p <= 1:
        raise ClientError(400, "top_p", f"must be in (0, 1], got {req.top_p}")
    if req.top_k < 0:
        raise ClientError(400, "top_k", f"must be >= 0 (0: every token), got {req.top_k}")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise ClientError(400, "seed", f"must be in 0..2**63-1, got {req.seed}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s or len(s) > 256 for s in stop):
        raise ClientError(400, "stop", "at most 4 stop texts, each 1 to 256 characters")
    return stop


class _Events:
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
            # The one rule of an evaluation context (EvalConfig.context's): a field left unset is the model's.
            ctx = model.config.context(mem_len=s.mem_len, same_length=s.same_length, clamp_len=s.clamp_len)
            m = Model(model, segment_len=s.segment_len, mem_len=ctx.mem_len, same_length=ctx.same_length,
                      clamp_len=ctx.clamp_len)
            store = SessionStore(s.state_dir, max_in_memory=s.max_sessions_in_memory, ttl=s.session_ttl)
            engine = Engine(m, tokenizer, store, max_queue=s.max_queue, max_batch=s.max_batch,
                            durable=s.durability == "request", metrics=self.metrics, threads=s.threads)
            engine.start()
            self.engine = engine
            logger.info("model %s ready: %d sessions in %s", self.name, len(store.last_used), s.state_dir)
        except Exception as err:  # noqa: BLE001 - the server stays up and says it failed
            self.failed = True
            logger.error("the model failed to load: %s", err)
            if self.on_load_error is not None:
                self.on_load_error(err)

    def ready(self) -> Engine:
        if self.engine is None:
            reason = "the model failed to load (see the server's log)" if self.failed else "the model is loading"
            raise ClientError(503, None, reason)
        return self.engine

    def owner(self, request: Request) -> str:
        if not self.keys:
            return ""
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ClientError(401, "Authorization", "a bearer key is required: Authorization: Bearer KEY")
        if not any(secrets.compare_digest(key.strip().encode(), k.encode()) for k in self.keys):
            raise ClientError(401, "Authorization", "the key is not valid")
        return owner_of(key.strip())

    def info(self, state) -> dict:
        m = self.engine.m
        return state.info(n_layer=m.n_layer, mem_len=m.mem_len, d_model=m.d_model)

    async def run(self, session: str | None, owner: str, work, *, changes: bool = True, create: dict | None = None,
                  delete: bool = False, events: _Events | None = None) -> Any:
        """Submit a job and wait for its result (its 'text' events go to ``events``' queue)."""
        engine = self.ready()
        if session is not None and not ID_PATTERN.match(session):
            raise ClientError(404, "session", "no such session (it was deleted, expired, or belongs to another key)")
        ev = events or _Events()
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


async def _json_body(request: Request, kind: type[BaseModel] | None = None, *, optional: bool = False):
    body = await request.body()
    if not body.strip():
        if optional:
            return kind() if kind else {}
        raise ClientError(400, "body", "a JSON body is required")
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise ClientError(400, "body", "the body is not UTF-8") from None
    except json.JSONDecodeError as err:
        raise ClientError(400, "body", f"malformed JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(data, dict):
        raise ClientError(422, "body", "must be a JSON object")
    if kind is None:
        return data
    from pydantic import ValidationError

    try:
        return kind.model_validate(data)
    except ValidationError as err:
        raise _validation(err.errors()) from None


def _validation(errors) -> ClientError:
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    # The field, and list positions in it; not pydantic's union tags ('str', 'list[str]').
    field = ".".join([str(loc[0])] + [str(x) for x in loc[1:] if isinstance(x, int)]) if loc else "body"
    if e.get("type") == "json_invalid":
        return ClientError(400, "body", "malformed JSON")
    reason = e.get("msg", "invalid")
    if e.get("type") == "extra_forbidden":
        reason = "unknown field"
    return ClientError(422, field, reason)


def _flag(value: str | None, name: str) -> bool:
    if value is None:
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ClientError(422, name, "must be true or false")


def create_app(config: ServeConfig, load: Callable[[], tuple[Any, Any, str]],
               on_load_error: Callable[[Exception], None] | None = None) -> FastAPI:
    """The app; ``load()`` returns (model, tokenizer, model name) and runs in a thread after start-up, the
    routes answering 503 until it is done (``on_load_error(err)`` if it fails). At shutdown the requests in
    flight drain and sessions are written."""
    srv = Server(config, load, on_load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=srv.load_model, name="txl-serve-load", daemon=True)
        loader.start()
        yield
        await asyncio.to_thread(loader.join)
        if srv.engine is not None:
            await asyncio.to_thread(srv.engine.stop, config.drain_seconds)

    app = FastAPI(title="txl serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(ClientError)
    async def _client_error(request: Request, err: ClientError):
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        if err.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return error_response(err.status, err.field, err.reason, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        e = _validation(err.errors())
        return error_response(e.status, e.field, e.reason)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        reason = {404: "no such endpoint", 405: "method not allowed"}.get(err.status_code, str(err.detail))
        if isinstance(err, BodyTooLarge):
            reason = str(err.detail)
        return error_response(err.status_code, "body" if err.status_code == 413 else None, reason)

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        logger.exception("internal error", exc_info=err)
        return error_response(500, None, "internal error (see the server's log)")

    limit = config.max_body_bytes
    inner = app.build_middleware_stack

    def guarded():  # one ASGI wrapper: body limit, access log, request metrics
        stack = inner()

        async def guard(scope, receive, send):
            if scope["type"] != "http":
                return await stack(scope, receive, send)
            start, status, received = time.perf_counter(), [0], [0]
            length = dict(scope.get("headers", [])).get(b"content-length")

            async def send_(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            async def receive_():
                message = await receive()
                if message["type"] == "http.request":
                    received[0] += len(message.get("body", b""))
                    if received[0] > limit:
                        raise BodyTooLarge(limit)
                return message

            try:
                if length is not None and length.isdigit() and int(length) > limit:
                    await error_response(413, "body", str(BodyTooLarge(limit).detail))(scope, receive, send_)
                else:
                    await stack(scope, receive_, send_)
            finally:
                seconds = time.perf_counter() - start
                route = getattr(scope.get("route"), "path", "other")
                srv.metrics.requests.labels(route, str(status[0])).inc()
                srv.metrics.latency.labels(route).observe(seconds)
                client = scope.get("client") or ("-", 0)
                access_log.info('%s "%s %s" %d %.1fms', client[0], scope["method"], scope["path"], status[0],
                                seconds * 1000)
        return guard

    app.build_middleware_stack = guarded  # type: ignore[method-assign]
    _routes(app, srv)
    return app


def _routes(app: FastAPI, srv: Server) -> None:  # noqa: C901 - one place for every route
    config = srv.config

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(resources.files("txl.serve").joinpath("page.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        if srv.engine is None:
            status = "failed" if srv.failed else "loading"
            return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})
        if srv.engine.failure is not None:  # the model worker is gone: every model request answers 503
            return JSONResponse({"status": "failed", "reason": srv.engine.failure}, status_code=503)
        return {"status": "draining" if srv.engine.stopping else "ok", "model": srv.name,
                "level": srv.engine.tokenizer.level, "segment_len": srv.engine.m.segment_len,
                "mem_len": srv.engine.m.mem_len}

    @app.get("/metrics")
    async def metrics(request: Request):
        srv.owner(request)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.owner(request)
        srv.ready()
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "owned_by": "txl", "created": 0}]}

    # -- sessions ---------------------------------------------------------------------------------------
    @app.post("/v1/sessions", status_code=201)
    async def create(request: Request):
        owner = srv.owner(request)
        srv.ready()
        data = await _json_body(request, optional=True)
        unknown = sorted(set(data) - {"memory"})
        if unknown:
            raise ClientError(422, unknown[0], "unknown field")
        memory = data.get("memory", True)
        if not isinstance(memory, bool):
            raise ClientError(422, "memory", "must be true or false")
        return await srv.run(None, owner, lambda s, j: srv.info(s), create={"with_memory": memory})

    @app.get("/v1/sessions/{sid}")
    async def get(sid: str, request: Request):
        owner = srv.owner(request)
        return await srv.run(sid, owner, lambda s, j: srv.info(s), changes=False)

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str, request: Request):
        owner = srv.owner(request)
        return await srv.run(sid, owner, lambda s, j: {"id": s.id, "object": "session", "deleted": True},
                             changes=False, delete=True)

    @app.post("/v1/sessions/{sid}/text")
    async def text(sid: str, request: Request):
        owner = srv.owner(request)
        srv.ready()
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "application/json":
            data = await _json_body(request)
            unknown = sorted(set(data) - {"text", "logprobs", "final"})
            if unknown:
                raise ClientError(422, unknown[0], "unknown field")
            body = data.get("text")
            if not isinstance(body, str):
                raise ClientError(422 if "text" in data else 400, "text",
                                  "must be a string" if "text" in data else "is required")
            logprobs, final = data.get("logprobs", False), data.get("final", False)
            for name, value in (("logprobs", logprobs), ("final", final)):
                if not isinstance(value, bool):
                    raise ClientError(422, name, "must be true or false")
        else:  # a raw body: text/plain or application/octet-stream, UTF-8 possibly cut anywhere
            body = await request.body()
            logprobs = _flag(request.query_params.get("logprobs"), "logprobs")
            final = _flag(request.query_params.get("final"), "final")
        if len(body) > config.max_text_chars:
            raise ClientError(413, "text", f"longer than serve.max_text_chars={config.max_text_chars}")
        if not body and not final:
            raise ClientError(400, "text", "is empty: send some text (or final: true to end the document)")
        engine = srv.engine

        def work(state, job):
            ids, lps = yield from engine.read_text(state, body, final=final)
            reply = {"id": state.id, "object": "session.text", "tokens": len(ids), "scored": len(lps),
                     "nll": -sum(lps), "session": srv.info(state)}
            if logprobs:
                unscored = len(ids) - len(lps)
                reply["logprobs"] = [{"token": engine.tokenizer.token_text(t), "logprob": None if i < unscored else
                                      lps[i - unscored]} for i, t in enumerate(ids)]
            return reply

        return await srv.run(sid, owner, work)

    @app.post("/v1/sessions/{sid}/generate")
    async def generate(sid: str, request: Request):
        owner = srv.owner(request)
        srv.ready()
        req = await _json_body(request, GenerateRequest, optional=True)
        stop = _check_sampling(req, config.max_tokens)
        engine = srv.engine
        events = _Events() if req.stream else None

        def work(state, job):
            out = yield from engine.generate(
                state, max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                seed=req.seed, stop=stop, job=job, top_logprobs=0,
                on_text=(lambda piece: events.emit("text", piece)) if events else None)
            reply = {"id": state.id, "object": "session.generation", "text": out["text"], "tokens": len(out["ids"]),
                     "finish_reason": out["finish_reason"], "session": srv.info(state)}
            if req.logprobs:
                reply["logprobs"] = [{"token": engine.tokenizer.token_text(t), "logprob": lp}
                                     for t, lp in zip(out["ids"], out["logprobs"])]
            return reply

        if events is None:
            return await srv.run(sid, owner, work)
        job = await srv.run(sid, owner, work, events=events)
        return await _sse(events, job, lambda kind, data: {"text": data} if kind == "text" else
                          {"text": "", "finish_reason": data["finish_reason"], "session": data["session"]})

    # -- OpenAI completions -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        owner = srv.owner(request)
        srv.ready()
        req = await _json_body(request, CompletionRequest)
        stop = _check_sampling(req, config.max_tokens)
        if isinstance(req.prompt, list):
            if len(req.prompt) != 1:
                raise ClientError(400, "prompt", "give one prompt (a string, or a list of one string)")
            prompt = req.prompt[0]
        else:
            prompt = req.prompt
        if len(prompt) > config.max_text_chars:
            raise ClientError(413, "prompt", f"longer than serve.max_text_chars={config.max_text_chars}")
        if req.n != 1 or req.best_of not in (None, 1):
            raise ClientError(400, "n" if req.n != 1 else "best_of", "only 1 is supported")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise ClientError(400, "logprobs", f"must be in 0..5, got {req.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) != 0:
                raise ClientError(400, name, "is not supported (only 0)")
        if req.logit_bias or req.suffix:
            raise ClientError(400, "logit_bias" if req.logit_bias else "suffix", "is not supported")
        if req.session is None and not prompt:
            raise ClientError(400, "prompt", "is empty: give a text to continue (or a session)")
        engine = srv.engine
        events = _Events() if req.stream else None
        cid, created = "cmpl-" + secrets.token_urlsafe(18), int(time.time())

        def work(state, job):
            ids, lps = (yield from engine.read_text(state, prompt, final=False)) if prompt else ([], [])
            out = yield from engine.generate(
                state, max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                seed=req.seed, stop=stop, job=job, top_logprobs=req.logprobs or 0,
                on_text=(lambda piece: events.emit("text", piece)) if events else None)
            return {"prompt_ids": ids, "prompt_logprobs": lps, **out,
                    "session": srv.info(state) if req.session is not None else None}


        def choice(text: str, finish: str | None, logprobs=None) -> dict:
            return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

        def logprob_block(out: dict) -> dict | None:
            if req.logprobs is None:
                return None
            tok = engine.tokenizer.token_text
            ids, lps, tops = list(out["ids"]), list(out["logprobs"]), list(out["top_logprobs"])
            if req.echo:
                unscored = len(out["prompt_ids"]) - len(out["prompt_logprobs"])
                ids = list(out["prompt_ids"]) + ids
                lps = [None] * unscored + list(out["prompt_logprobs"]) + lps
                tops = [None] * len(out["prompt_ids"]) + tops
            texts = [tok(t) for t in ids]
            offsets, pos = [], 0
            for t in texts:
                offsets.append(pos)
                pos += len(t)
            return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops if req.logprobs else None,
                    "text_offset": offsets}

        def usage(out: dict) -> dict:
            p, c = len(out["prompt_ids"]), len(out["ids"])
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        finish_of = {"cancelled": "length"}
        if events is None:
            out = await srv.run(req.session, owner, work)
            text = (prompt if req.echo else "") + out["text"]
            return {"id": cid, "object": "text_completion", "created": created, "model": srv.name,
                    "choices": [choice(text, finish_of.get(out["finish_reason"], out["finish_reason"]),
                                       logprob_block(out))], "usage": usage(out),
                    **({"session": out["session"]} if out["session"] else {})}

        def chunk(kind: str, data: Any) -> dict:
            base = {"id": cid, "object": "text_completion", "created": created, "model": srv.name}
            if kind == "text":
                return {**base, "choices": [choice(data, None)]}
            return {**base, "choices": [choice("", finish_of.get(data["finish_reason"], data["finish_reason"]),
                                               logprob_block(data))], "usage": usage(data)}

        job = await srv.run(req.session, owner, work, events=events)
        first = [("text", prompt)] if req.echo and prompt else []
        return await _sse(events, job, chunk, first=first)


async def _sse(events: _Events, job: Job, render: Callable[[str, Any], dict], first: list | None = None):
    """A streamed answer: an error before the first event is a plain JSON error; then server-sent events,
    ``data: {...}`` each, ending with ``data: [DONE]``. A client that goes away cancels the generation at
    the next token; what was generated stays in the session."""
    kind, data = await events.queue.get()
    if kind == "error":
        raise data

    async def stream():
        nonlocal kind, data
        try:
            for k, d in first or []:
                yield f"data: {json.dumps(render(k, d))}\n\n"
            while True:
                if kind == "error":
                    err = data if isinstance(data, ClientError) else ClientError(500, None, "internal error")
                    yield f"data: {json.dumps({'error': {'field': err.field, 'reason': err.reason}})}\n\n"
                    break
                yield f"data: {json.dumps(render(kind, data))}\n\n"
                if kind == "done":
                    break
                kind, data = await events.queue.get()
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True  # no effect once it is done; stops the generation if the client left

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
