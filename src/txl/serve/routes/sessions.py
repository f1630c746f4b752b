"""/v1/sessions: create, inspect and delete a session; read text into it; generate from its memory."""

from __future__ import annotations

import codecs
from typing import Annotated

from fastapi import APIRouter, Request

from txl.serve.deps import Owner, Ready, Srv, body, get_and_head, media_type, read_json
from txl.serve.engine import Engine
from txl.serve.protocol import TEXT_TYPES, CreateSession, GenerateBody, TextBody, TextQuery, parse
from txl.serve.responses import ERRORS, Deleted, Generation, GenerationChunk, SessionInfo, TextRead, stream_of
from txl.serve.server import Events, sse
from txl.serve.session import ClientError

router = APIRouter(prefix="/v1/sessions", responses=ERRORS)


@router.post("", status_code=201, response_model=SessionInfo, response_model_exclude_unset=True)
async def create(srv: Srv, owner: Owner, req: Annotated[CreateSession, body(CreateSession, optional=True)]):
    return await srv.run(None, owner, lambda s, j: srv.info(s), create={"with_memory": req.memory})


@get_and_head(router, "/{sid}", response_model=SessionInfo, response_model_exclude_unset=True)
async def get(sid: str, srv: Srv, owner: Owner):
    return await srv.run(sid, owner, lambda s, j: srv.info(s), changes=False)


@router.delete("/{sid}", response_model=Deleted)
async def delete(sid: str, srv: Srv, owner: Owner):
    return await srv.run(sid, owner, lambda s, j: {"id": s.id, "object": "session", "deleted": True},
                         changes=False, delete=True)


def is_utf8(charset: str) -> bool:
    try:
        return codecs.lookup(charset).name == "utf-8"
    except LookupError:
        return False


def decode_charset(body: bytes, charset: str) -> str:
    """A raw text body in a declared charset other than UTF-8 (``text/plain; charset=latin-1``), decoded whole: a
    charset Python does not know is a 415, bytes that are not text in it a 400."""
    try:
        codec = codecs.lookup(charset)
    except LookupError:
        raise ClientError(415, "Content-Type", f"charset={charset} is not a known text encoding: send the text as "
                          "UTF-8 (text/plain; charset=utf-8) or name its encoding (latin-1, cp1252, ...)") from None
    try:
        return codec.decode(body)[0]
    except UnicodeDecodeError as err:
        raise ClientError(400, "text", f"not {charset} text (byte {err.start}: {err.reason}); a body in a charset "
                          "other than UTF-8 is read whole, so send whole characters") from None


@router.post("/{sid}/text", response_model=TextRead, response_model_exclude_unset=True)
async def text(sid: str, request: Request, srv: Srv, owner: Owner, engine: Ready):
    kind, params = media_type(request)
    if kind not in TEXT_TYPES:
        raise ClientError(415, "Content-Type", f"{kind or 'none'} is not read: send application/json "
                          "({\"text\": ...}) or the text itself as text/plain or application/octet-stream")
    if kind == "application/json":
        req = parse(TextBody, await read_json(request))
        data: str | bytes = req.text
    else:  # a raw body, the flags in the query: UTF-8 possibly cut anywhere, or text in the charset it declares
        req = parse(TextQuery, dict(request.query_params))
        data = await request.body()
        charset = params.get("charset", "utf-8") if kind == "text/plain" else "utf-8"
        if not is_utf8(charset):
            data = decode_charset(data, charset)
    limit = srv.config.max_text_chars
    if len(data) > limit:
        raise ClientError(413, "text", f"longer than serve.max_text_chars={limit}")
    if not data and not req.final:
        raise ClientError(400, "text", "is empty: send some text (or final: true to end the document)")

    def work(state, job):
        ids, lps = yield from engine.read_text(state, data, final=req.final)
        reply = {"id": state.id, "object": "session.text", "tokens": len(ids), "scored": len(lps),
                 "nll": -sum(lps), "session": srv.info(state)}
        if req.logprobs:
            unscored = len(ids) - len(lps)
            reply["logprobs"] = [{"token": engine.tokenizer.token_text(t), "logprob": None if i < unscored else
                                  lps[i - unscored]} for i, t in enumerate(ids)]
        return reply

    return await srv.run(sid, owner, work)


def generation(engine: Engine, state, req, job, events: Events | None, top_logprobs: int = 0, tokens: bool = False,
               starts: list[int] | None = None):
    """The engine's generation with a request's sampling settings (its text pieces to ``events``, and with
    ``tokens`` each token drawn, (id, log-prob, top alternatives), as a 'token' event before its text). ``starts``
    gets where each token's text starts in the generated text (the text shown before it: ``Engine.generate``'s
    ``on_token``)."""
    emit = events is not None and tokens

    def on_token(*t) -> None:
        if starts is not None and t[0] is not None:
            starts.append(t[3])
        if emit:
            events.emit("token", t)

    return engine.generate(state, max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                           top_p=req.top_p, repetition_penalty=req.repetition_penalty, seed=req.seed,
                           stop=req.stop_texts, stop_tokens=req.stop_token_ids or (), job=job,
                           top_logprobs=top_logprobs,
                           on_text=(lambda piece: events.emit("text", piece)) if events else None,
                           on_token=on_token if emit or starts is not None else None)


@router.post("/{sid}/generate", response_model=Generation, response_model_exclude_unset=True,
             responses=stream_of(GenerationChunk))
async def generate(sid: str, srv: Srv, owner: Owner, engine: Ready,
                   req: Annotated[GenerateBody, body(GenerateBody, optional=True)]):
    events = Events() if req.stream else None

    def work(state, job):
        out = yield from generation(engine, state, req, job, events)
        reply = {"id": state.id, "object": "session.generation", "text": out["text"], "tokens": len(out["ids"]),
                 "finish_reason": out["finish_reason"], "session": srv.info(state)}
        if req.logprobs:
            reply["logprobs"] = [{"token": engine.tokenizer.token_text(t), "logprob": lp}
                                 for t, lp in zip(out["ids"], out["logprobs"])]
        return reply

    if events is None:
        return await srv.run(sid, owner, work)
    job = await srv.run(sid, owner, work, events=events)
    return await sse(events, job, lambda kind, data: {"text": data} if kind == "text" else
                     {"text": "", "finish_reason": data["finish_reason"], "session": data["session"]},
                     model=GenerationChunk)
