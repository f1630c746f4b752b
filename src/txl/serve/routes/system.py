"""The page at /, /health (no key needed), /metrics and /v1/models."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from txl.serve import openai
from txl.serve.deps import Owner, Ready, Srv, get_and_head
from txl.serve.responses import ERRORS, Health, ModelCard, ModelList, Unavailable
from txl.serve.session import ClientError

router = APIRouter()


@router.api_route("/", response_class=HTMLResponse, include_in_schema=False, methods=["GET", "HEAD"])
async def page():
    return HTMLResponse(resources.files("txl.serve").joinpath("page.html").read_text(encoding="utf-8"))


@router.api_route("/favicon.ico", include_in_schema=False, methods=["GET", "HEAD"])
async def favicon():
    """No icon (the page names an empty one, ``data:,``): a browser that asks anyway gets 204, not a logged 404."""
    return Response(status_code=204)


@get_and_head(router, "/health", response_model=Health, responses={503: {"model": Unavailable}})
async def health(srv: Srv):
    if srv.engine is None:
        status = "failed" if srv.failed else "loading"
        return JSONResponse(Unavailable(status=status).model_dump(exclude_unset=True), status_code=503,
                            headers={"Retry-After": "1"})
    if srv.engine.failure is not None:  # the model worker is gone: every model request answers 503
        return JSONResponse(Unavailable(status="failed", reason=srv.engine.failure).model_dump(), status_code=503)
    return {"status": "draining" if srv.engine.stopping else "ok", "model": srv.name,
            "level": srv.engine.tokenizer.level, "segment_len": srv.engine.m.segment_len,
            "mem_len": srv.engine.m.mem_len, "same_length": srv.engine.m.read_ctx.same_length,
            "clamp_len": srv.engine.m.read_ctx.clamp_len}


@get_and_head(router, "/metrics", response_class=Response,
              responses={200: {"content": {"text/plain": {}}}, 401: ERRORS[401]})
async def metrics(srv: Srv, _: Owner):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@get_and_head(router, "/v1/models", response_model=ModelList, responses=ERRORS)
async def models(srv: Srv, _: Ready):
    return openai.model_list(srv.name)


@get_and_head(router, "/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
async def model(model: str, srv: Srv, _: Ready):
    """The served model's card (a Hub id's slash included); another name is a 404, as OpenAI answers."""
    if model != srv.name:
        raise ClientError(404, "model", f"no model {model!r} here: this server serves {srv.name!r}")
    return openai.model_card(srv.name)
