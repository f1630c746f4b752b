"""/v1/completions: OpenAI's completions, on a temporary session or (``session``) a named one.

A prompt is a text, or token ids (llama.cpp's and vLLM's extension, what lm-evaluation-harness sends); a list
of them is a batch, one choice each (index in the order given), each prompt a temporary session of its own,
so the engine reads them in one batched forward. A text prompt is read as a document is (after the tokenizer's
context token, ``<eos>`` or the line break: its first token is scored); token ids are read exactly as given (the
first is the context of the rest, its log-prob None), so a client that puts the prefix token first (lm-eval's
``eos_token``) gets what `txl score` gives for the document.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Annotated

from fastapi import APIRouter

from txl.serve import openai
from txl.serve.deps import Owner, Ready, Srv, body
from txl.serve.protocol import CompletionBody, Prompt
from txl.serve.responses import ERRORS, Completion, CompletionChunk, stream_of
from txl.serve.routes.sessions import generation
from txl.serve.server import Events, sse
from txl.serve.session import ClientError

router = APIRouter(responses=ERRORS)


def check_model(srv, model: str | None) -> None:
    """A request naming another model than the one served is refused (404), as OpenAI does."""
    if model is not None and model != srv.name:
        raise ClientError(404, "model", f"no model {model!r} here: this server serves {srv.name!r} "
                          "(GET /v1/models)")


def check_prompt(prompt: Prompt, i: int | None, *, vocab_size: int, limit: int, session: bool) -> None:
    field = "prompt" if i is None else f"prompt.{i}"
    if isinstance(prompt, str):
        if len(prompt) > limit:
            raise ClientError(413, field, f"longer than serve.max_text_chars={limit}")
        if not prompt and not session:
            raise ClientError(400, field, "is empty: give a text to continue (or a session)")
        return
    if len(prompt) > limit:
        raise ClientError(413, field, f"more than serve.max_text_chars={limit} tokens")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ClientError(400, field, f"token id {bad} is out of range: the vocabulary has ids 0..{vocab_size - 1}")


@router.post("/v1/completions", response_model=Completion, response_model_exclude_unset=True,
             responses=stream_of(CompletionChunk))
async def completions(srv: Srv, owner: Owner, engine: Ready,
                      req: Annotated[CompletionBody, body(CompletionBody)]):
    check_model(srv, req.model)
    prompts = req.prompts
    batch = len(prompts) > 1 or (isinstance(req.prompt, list) and not isinstance(req.prompt[0], int))
    for i, p in enumerate(prompts):
        check_prompt(p, i if batch else None, vocab_size=engine.m.model.config.vocab_size,
                     limit=srv.config.max_text_chars, session=req.session is not None)
    if len(prompts) > 1 and req.session is not None:
        raise ClientError(400, "session", "a session continues one prompt; send the prompts one at a time")
    if len(prompts) > 1 and req.stream:
        raise ClientError(400, "stream", "streams one prompt; send a batch without stream")
    cid, created = "cmpl-" + secrets.token_urlsafe(18), int(time.time())
    top = req.logprobs if req.echo and req.logprobs else 0
    tok = engine.tokenizer
    words = tok.level == "word"
    eos = tok.token_text(tok.eos_id) if words and tok.eos_id is not None else None

    def work_of(prompt: Prompt, events: Events | None):
        def work(state, job):
            tops: list = []
            if isinstance(prompt, str):
                ids, lps = (yield from engine.read_prompt(state, prompt, top=top, tops=tops)) if prompt else ([], [])
                text = prompt
            else:
                if state.n_tokens == 0:  # token ids are read as given: no context token before them
                    state.tokens = []
                ids, text = list(prompt), tok.decode(prompt)
                lps = yield from engine.read_ids(state, ids, top=top, tops=tops)
                state.chars += len(text)
            prompt_starts = openai.token_starts(text, [tok.token_text(i) for i in ids], words=words, eos=eos)
            if events is not None and req.echo:
                events.emit("echo", {"text": text, "prompt_ids": ids, "prompt_logprobs": lps,
                                     "prompt_top_logprobs": tops, "prompt_starts": prompt_starts})
            starts: list[int] = []
            out = yield from generation(engine, state, req, job, events, top_logprobs=req.logprobs or 0,
                                        tokens=req.logprobs is not None, starts=starts)
            return {"prompt_ids": ids, "prompt_logprobs": lps, "prompt_top_logprobs": tops, "prompt_text": text,
                    "prompt_starts": prompt_starts, **out, "starts": starts,
                    "session": srv.info(state) if req.session is not None else None}
        return work

    if not req.stream:
        outs = await asyncio.gather(*(srv.run(req.session, owner, work_of(p, None)) for p in prompts))
        blocks = [openai.logprob_block(o, logprobs=req.logprobs, echo=req.echo, token_text=tok.token_text)
                  for o in outs]
        texts = [(o["prompt_text"] if req.echo else "") + o["text"] for o in outs]
        return openai.completion(outs, cid=cid, created=created, model=srv.name, texts=texts, logprobs=blocks)
    events = Events()
    job = await srv.run(req.session, owner, work_of(prompts[0], events), events=events)
    usage = req.stream_options is not None and req.stream_options.include_usage
    return await sse(events, job, openai.Chunks(cid=cid, created=created, model=srv.name, logprobs=req.logprobs,
                                                token_text=tok.token_text, include_usage=usage), model=CompletionChunk)
