"""The app: ``create_app`` wires the layers together.

``protocol`` (request models, the one validation), ``responses`` (response models; both listed at /openapi.json),
``deps`` (server state, auth and readiness as FastAPI dependencies, bodies as models), ``routes/`` (one APIRouter
per endpoint group), ``openai`` (the OpenAI formats), ``server`` (state, jobs submitted to the engine, server-sent
events), ``middleware`` (errors as JSON, body limit, access log, metrics) and, below them all, ``engine`` and
``session``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from txl.serve.config import ServeConfig
from txl.serve.middleware import add_error_handlers, error_response, guard
from txl.serve.responses import STREAMED
from txl.serve.routes import ROUTERS
from txl.serve.server import Server

__all__ = ["Server", "create_app", "error_response"]


def add_streamed_schemas(app: FastAPI) -> None:
    """/openapi.json with the streamed chunks' models (``responses.STREAMED``) among its schemas: the routes refer
    to them for ``text/event-stream``, and FastAPI lists only models a route returns or reads whole."""
    def schema() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            out = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = out.setdefault("components", {}).setdefault("schemas", {})
            for model in STREAMED:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(js.pop("$defs", {}))
                schemas[model.__name__] = js
            app.openapi_schema = out
        return app.openapi_schema

    app.openapi = schema


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

    # /openapi.json: every route's request and response models (no pages of docs: nothing served from a CDN).
    app = FastAPI(title="txl serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    add_streamed_schemas(app)
    app.state.server = srv
    add_error_handlers(app)
    if config.origins:  # CORS only when asked for: by default a browser lets no other site's page call the API
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.origins, allow_methods=["*"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    guard(app, limit=config.max_body_bytes, metrics=srv.metrics)
    for router in ROUTERS:
        app.include_router(router)
    return app
