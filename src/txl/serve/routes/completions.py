"""/v1/completions: OpenAI's completions, on a temporary session or (``session``) a named one."""

from __future__ import annotations

import secrets
import time
from functools import partial
from typing import Annotated

from fastapi import APIRouter

from txl.serve import openai
from txl.serve.deps import Owner, Ready, Srv, body
from txl.serve.protocol import CompletionBody
from txl.serve.routes.sessions import generation
from txl.serve.server import Events, sse
from txl.serve.session import ClientError

router = APIRouter()


@router.post("/v1/completions")
async def completions(srv: Srv, owner: Owner, engine: Ready,
                      req: Annotated[CompletionBody, body(CompletionBody)]):
    prompt = req.prompt_text
    limit = srv.config.max_text_chars
    if len(prompt) > limit:
        raise ClientError(413, "prompt", f"longer than serve.max_text_chars={limit}")
    if req.session is None and not prompt:
        raise ClientError(400, "prompt", "is empty: give a text to continue (or a session)")
    events = Events() if req.stream else None
    cid, created = "cmpl-" + secrets.token_urlsafe(18), int(time.time())

    def work(state, job):
        # A prompt is whole text: read to its end (a word-level model's last word too), not held as pending.
        ids, lps = (yield from engine.read_prompt(state, prompt)) if prompt else ([], [])
        out = yield from generation(engine, state, req, job, events, top_logprobs=req.logprobs or 0)
        return {"prompt_ids": ids, "prompt_logprobs": lps, **out,
                "session": srv.info(state) if req.session is not None else None}

    logprobs = partial(openai.logprob_block, logprobs=req.logprobs, echo=req.echo,
                       token_text=engine.tokenizer.token_text)
    if events is None:
        out = await srv.run(req.session, owner, work)
        return openai.completion(out, cid=cid, created=created, model=srv.name,
                                 text=(prompt if req.echo else "") + out["text"], logprobs=logprobs(out))
    job = await srv.run(req.session, owner, work, events=events)
    first = [("text", prompt)] if req.echo and prompt else []
    return await sse(events, job, partial(openai.chunk, cid=cid, created=created, model=srv.name,
                                          logprobs=logprobs), first=first)
