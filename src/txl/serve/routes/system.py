"""The page at /, /health (no key needed), /metrics and /v1/models."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from txl.serve import openai
from txl.serve.deps import Owner, Ready, Srv

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page():
    return HTMLResponse(resources.files("txl.serve").joinpath("page.html").read_text(encoding="utf-8"))


@router.get("/health")
async def health(srv: Srv):
    if srv.engine is None:
        status = "failed" if srv.failed else "loading"
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})
    return {"status": "draining" if srv.engine.stopping else "ok", "model": srv.name,
            "level": srv.engine.tokenizer.level, "segment_len": srv.engine.m.segment_len,
            "mem_len": srv.engine.m.mem_len}


@router.get("/metrics")
async def metrics(srv: Srv, _: Owner):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(srv: Srv, _: Ready):
    return openai.model_list(srv.name)
