"""The page at /, /health (no key needed), /metrics and /v1/models."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from txl.serve import openai
from txl.serve.deps import Owner, Ready, Srv
from txl.serve.session import ClientError

router = APIRouter()


@router.api_route("/", response_class=HTMLResponse, include_in_schema=False, methods=["GET", "HEAD"])
async def page():
    return HTMLResponse(resources.files("txl.serve").joinpath("page.html").read_text(encoding="utf-8"))


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(srv: Srv):
    if srv.engine is None:
        status = "failed" if srv.failed else "loading"
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})
    if srv.engine.failure is not None:  # the model worker is gone: every model request answers 503
        return JSONResponse({"status": "failed", "reason": srv.engine.failure}, status_code=503)
    return {"status": "draining" if srv.engine.stopping else "ok", "model": srv.name,
            "level": srv.engine.tokenizer.level, "segment_len": srv.engine.m.segment_len,
            "mem_len": srv.engine.m.mem_len, "same_length": srv.engine.m.read_ctx.same_length,
            "clamp_len": srv.engine.m.read_ctx.clamp_len}


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(srv: Srv, _: Owner):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.api_route("/v1/models", methods=["GET", "HEAD"])
async def models(srv: Srv, _: Ready):
    return openai.model_list(srv.name)


@router.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
async def model(model: str, srv: Srv, _: Ready):
    """The served model's card (a Hub id's slash included); another name is a 404, as OpenAI answers."""
    if model != srv.name:
        raise ClientError(404, "model", f"no model {model!r} here: this server serves {srv.name!r}")
    return openai.model_card(srv.name)
