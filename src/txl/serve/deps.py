"""FastAPI dependencies: the server's state, the caller's key (auth), the engine once the model is ready,
and a request's JSON body read as one of ``protocol``'s models; ``get_and_head`` registers a route for both.

A route names what it needs in its signature (``owner: Owner``, ``engine: Ready``); FastAPI resolves the
dependencies in that order, so a missing key is a 401 before a loading model's 503, as before.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from txl.serve.engine import Engine
from txl.serve.protocol import decode_json, parse
from txl.serve.server import Server
from txl.serve.session import ClientError, owner_of


def server(request: Request) -> Server:
    return request.app.state.server


def owner(request: Request) -> str:
    """Who the caller is (the hash of its key; '' without keys), or a 401."""
    srv: Server = request.app.state.server
    if not srv.keys:
        return ""
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise ClientError(401, "Authorization", "a bearer key is required: Authorization: Bearer KEY")
    if not any(secrets.compare_digest(key.strip().encode(), k.encode()) for k in srv.keys):
        raise ClientError(401, "Authorization", "the key is not valid")
    return owner_of(key.strip())


def ready(request: Request, _: Annotated[str, Depends(owner)]) -> Engine:
    """The engine once the model is loaded (after the key is checked), or a 503."""
    return request.app.state.server.ready()


Srv = Annotated[Server, Depends(server)]
Owner = Annotated[str, Depends(owner)]
Ready = Annotated[Engine, Depends(ready)]


def media_type(request: Request) -> tuple[str, dict[str, str]]:
    """The request's media type, lower case ('application/octet-stream' when it names none: RFC 9110 8.3), and
    its parameters (``charset``: lower case, unquoted)."""
    kind, *params = request.headers.get("content-type", "application/octet-stream").split(";")
    found = {}
    for param in params:
        name, _, value = param.partition("=")
        found[name.strip().lower()] = value.strip().strip('"').lower()
    return kind.strip().lower(), found


JSON_CHARSETS = ("utf-8", "utf8")


async def read_json(request: Request, *, optional: bool = False) -> Any:
    """The decoded JSON body ({} for an empty ``optional`` one), or a 400; a body of another type than
    ``application/json`` (UTF-8, RFC 8259) is a 415, the one rule of every endpoint that reads JSON."""
    body = await request.body()
    if not body.strip():
        if optional:
            return {}
        raise ClientError(400, "body", "a JSON body is required")
    kind, params = media_type(request)
    if kind != "application/json" or params.get("charset", "utf-8") not in JSON_CHARSETS:
        given = kind + (f"; charset={params['charset']}" if "charset" in params else "")
        raise ClientError(415, "Content-Type", f"{given} is not read here: send the body as JSON with "
                          "Content-Type: application/json (UTF-8)")
    return decode_json(body)


def body(kind: type[BaseModel], *, optional: bool = False):
    """A dependency: the request's JSON body as a ``kind`` (validated with the server's limits in context)."""

    async def dependency(request: Request, _: Annotated[Engine, Depends(ready)]) -> BaseModel:
        data = await read_json(request, optional=optional)
        config = request.app.state.server.config
        limits = {"max_tokens": config.max_tokens, "max_batch": config.max_batch}
        return parse(kind, data, context=limits)

    return Depends(dependency)


def get_and_head(router: APIRouter, path: str, **options):
    """A decorator: the route at ``path`` answers GET and HEAD (the same handler; HEAD without the body). The HEAD
    twin is left out of /openapi.json, whose operations are one per method, so its id would repeat GET's."""

    def register(handler):
        router.api_route(path, methods=["HEAD"], include_in_schema=False, **options)(handler)
        return router.api_route(path, methods=["GET"], **options)(handler)

    return register
