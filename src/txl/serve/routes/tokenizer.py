"""The tokenizer over HTTP, as vLLM serves it: POST /tokenize, POST /detokenize, GET /tokenizer_info.

lm-evaluation-harness's ``local-completions`` finds these by itself (its ``remote`` tokenizer backend) and
then needs nothing but ``base_url`` and ``model``: it tokenises documents here, reads ``eos_token`` as the
prefix it puts before each, and sends token-id prompts. ``/tokenize`` gives a completion's text-prompt ids
(``Tokenizer.encode_prompt``: a word-level text gets ``<eos>`` after each line break, none after its last
words); ``eos_token`` is the token read before a document (``Tokenizer.prefix_id``), as text that
``/tokenize`` turns into that one id.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter

from txl.serve.deps import Ready, Srv, body, get_and_head
from txl.serve.protocol import DetokenizeBody, TokenizeBody
from txl.serve.responses import ERRORS, Detokenized, Tokenized, TokenizerInfo
from txl.serve.routes.completions import check_model
from txl.serve.session import ClientError

router = APIRouter(responses=ERRORS)


@router.post("/tokenize", response_model=Tokenized, response_model_exclude_unset=True)
async def tokenize(srv: Srv, engine: Ready, req: Annotated[TokenizeBody, body(TokenizeBody)]):
    check_model(srv, req.model)
    if len(req.prompt) > srv.config.max_text_chars:
        raise ClientError(413, "prompt", f"longer than serve.max_text_chars={srv.config.max_text_chars}")
    try:
        ids = [int(i) for i in engine.tokenizer.encode_prompt(req.prompt)]
    except ValueError as err:  # a character or word the vocabulary cannot encode
        raise ClientError(400, "prompt", str(err)) from None
    out = {"count": len(ids), "max_model_len": None, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [engine.tokenizer.token_text(i) for i in ids]
    return out


@router.post("/detokenize", response_model=Detokenized)
async def detokenize(srv: Srv, engine: Ready, req: Annotated[DetokenizeBody, body(DetokenizeBody)]):
    check_model(srv, req.model)
    vocab = engine.m.model.config.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise ClientError(400, f"tokens.{bad}", f"token id {req.tokens[bad]} is out of range: the vocabulary has "
                          f"ids 0..{vocab - 1}")
    return {"prompt": engine.tokenizer.decode(req.tokens)}


@get_and_head(router, "/tokenizer_info", response_model=TokenizerInfo)
async def tokenizer_info(engine: Ready):
    tok = engine.tokenizer
    prefix = tok.prefix_id
    unk = tok.unk_id
    return {"tokenizer_class": f"txl-{tok.level}", "level": tok.level, "vocab_size": tok.vocab_size,
            "eos_token": None if prefix is None else tok.token_text(prefix), "eos_token_id": prefix,
            "bos_token": None, "pad_token": None, "unk_token": None if unk is None else tok.token_text(unk),
            "model_max_length": None, "chat_template": None}
