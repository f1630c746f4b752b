"""The app: ``create_app`` wires the layers together.

``protocol`` (request models, the one validation), ``deps`` (server state, auth and readiness as FastAPI
dependencies, bodies as models), ``routes/`` (one APIRouter per endpoint group), ``openai`` (the OpenAI
formats), ``server`` (state, jobs submitted to the engine, server-sent events), ``middleware`` (errors as JSON,
body limit, access log, metrics) and, below them all, ``engine`` and ``session``.
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
from txl.serve.routes import ROUTERS
from txl.serve.server import Server

__all__ = ["Server", "create_app", "error_response"]


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
    add_error_handlers(app)
    if config.origins:  # CORS only when asked for: by default a browser lets no other site's page call the API
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.origins, allow_methods=["*"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    guard(app, limit=config.max_body_bytes, metrics=srv.metrics)
    for router in ROUTERS:
        app.include_router(router)
    return app
