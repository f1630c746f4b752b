"""The HTTP edges every route shares: errors as JSON (the exception handlers), and one ASGI wrapper for
the body limit, the access log and the request metrics.

Every client error is ``{"error": {"field", "reason", "message", "type", "param", "code"}}`` (the OpenAI
shape, with the field at fault and why): 400 for a bad value, malformed or too deeply nested JSON, 401 for
a missing or wrong key, 404 for an unknown session (or another key's), 409 for a session another model made
(a state directory shared by two models), 413 for too large, 415 for a body
of a type the endpoint does not read, 422 for a wrong type or an unknown field, 429 when the queue is full,
503 while the model loads. Nothing a client sends yields a 500, and no error body holds a traceback or a
server path. A client that goes away before its body is read gets nothing (it is not there) and one access
line with 499 (nginx's 'client closed request'). Requests that uvicorn's HTTP parser itself refuses (a NUL
in the path, a negative Content-Length) never reach the app: uvicorn answers those with its own plain-text
400.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError, ResponseValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from txl.serve.metrics import Metrics
from txl.serve.protocol import client_error
from txl.serve.session import ClientError

logger = logging.getLogger("txl.serve.app")
access_log = logging.getLogger("txl.serve.access")

CLIENT_CLOSED = 499
"""The status logged for a request whose client left before it was answered (no response is sent)."""

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
          405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "unavailable"}


def error_response(status: int, field: str | None, reason: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": f"{field}: {reason}" if field else reason, "type": _TYPES.get(status, "server_error"),
                      "param": field, "field": field, "reason": reason, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than serve.max_body_bytes={limit}")


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientError)
    async def _client_error(request: Request, err: ClientError):
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        if err.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return error_response(err.status, err.field, err.reason, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        e = client_error(list(err.errors()))
        return error_response(e.status, e.field, e.reason)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        reason = {404: "no such endpoint", 405: "method not allowed"}.get(err.status_code, str(err.detail))
        if isinstance(err, BodyTooLarge):
            reason = str(err.detail)
        return error_response(err.status_code, "body" if err.status_code == 413 else None, reason)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, err: ClientDisconnect):  # nobody to answer: the access line says 499
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(ResponseValidationError)
    async def _not_its_model(request: Request, err: ResponseValidationError):
        # An answer that is not its response model (txl.serve.responses): a server bug, answered as a 500 here,
        # logged with the fields at fault rather than a traceback.
        logger.error("%s %s: the answer is not its response model: %s", request.method, request.url.path,
                     err.errors())
        return error_response(500, None, "internal error (see the server's log)")

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        logger.exception("internal error", exc_info=err)
        return error_response(500, None, "internal error (see the server's log)")


def guard(app: FastAPI, *, limit: int, metrics: Metrics) -> None:
    """Wrap the app's middleware stack in one ASGI function: the body limit (413, also for a chunked body),
    the access log (one line a request) and the request metrics."""
    inner = app.build_middleware_stack

    def guarded():
        stack = inner()

        async def call(scope, receive, send):
            if scope["type"] != "http":
                return await stack(scope, receive, send)
            start, status, received = time.perf_counter(), [0], [0]
            length = dict(scope.get("headers", [])).get(b"content-length")

            async def send_(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                    if status[0] == CLIENT_CLOSED:  # the client is gone: nothing goes out
                        return
                if status[0] == CLIENT_CLOSED:
                    return
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
            except Exception:
                if status[0] != 500:  # nothing answered yet, or a stream broken after its 200: the server's to end
                    raise
                # Answered and logged by the 500 handler; starlette raises it again for the server, and uvicorn
                # would then close the connection that a keep-alive client (httpx, the openai client) goes on using.
            finally:
                seconds = time.perf_counter() - start
                route = getattr(scope.get("route"), "path", "other")
                metrics.requests.labels(route, str(status[0])).inc()
                metrics.latency.labels(route).observe(seconds)
                client = scope.get("client") or ("-", 0)
                access_log.info('%s "%s %s" %d %.1fms', client[0], scope["method"], scope["path"], status[0],
                                seconds * 1000)
        return call

    app.build_middleware_stack = guarded  # type: ignore[method-assign]
