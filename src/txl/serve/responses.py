"""What the server answers: pydantic models of every JSON response body and streamed chunk.

The routes declare them (``response_model=``), so FastAPI validates each answer against its model and
/openapi.json lists them; a streamed answer's chunks are validated one by one (``txl.serve.server.sse``). The
routes and ``txl.serve.openai`` build plain dicts; the models say what those must hold. ``extra="forbid"``: a key
a route adds without declaring it here is a server error in the tests, not a silent change of the API. Fields
with a default of None are left out of an answer that does not set them (``response_model_exclude_unset``), as
``logprobs`` is when it was not asked for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Answer(BaseModel):
    """A response body: every key declared."""

    model_config = ConfigDict(extra="forbid")


# -- errors ----------------------------------------------------------------------------------------------------

class ErrorDetail(Answer):
    message: str
    """'field: reason', or the reason alone."""
    type: str
    """OpenAI's error type (invalid_request_error, authentication_error, not_found_error, ...)."""
    param: str | None
    """The field at fault (OpenAI's name for it)."""
    field: str | None
    reason: str
    code: int
    """The HTTP status."""


class ErrorBody(Answer):
    """Every client error (``txl.serve.middleware.error_response``)."""

    error: ErrorDetail


class StreamErrorDetail(Answer):
    field: str | None
    reason: str


class StreamError(Answer):
    """The last chunk of a stream that failed after it began (then ``data: [DONE]``)."""

    error: StreamErrorDetail


# -- system ------------------------------------------------------------------------------------------------------

class Health(Answer):
    """GET /health while the model serves: how it reads."""

    status: Literal["ok", "draining"]
    model: str
    level: str
    """The tokenizer's level: char, word, bpe, ..."""
    segment_len: int
    mem_len: int
    same_length: bool
    clamp_len: int


class Unavailable(Answer):
    """GET /health (503) while the model loads, or when it failed."""

    status: Literal["loading", "failed"]
    reason: str | None = None


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    owned_by: str
    created: int


class ModelList(Answer):
    object: Literal["list"]
    data: list[ModelCard]


# -- sessions ----------------------------------------------------------------------------------------------------

class MemoryInfo(Answer):
    shape: list[int]
    """(n_layer, rows held, d_model)."""
    max_shape: list[int]
    bytes: int


class CompressedInfo(MemoryInfo):
    rate: int
    """Memory rows per compressed row (cmem_rate)."""


class SessionInfo(Answer):
    """GET /v1/sessions/{id}, and the ``session`` of every answer that changed one."""

    id: str
    object: Literal["session"]
    with_memory: bool
    tokens_read: int
    tokens_generated: int
    tokens_scored: int
    nll: float
    """Summed negative log-likelihood of the tokens scored, in nats."""
    bits_per_token: float | None
    chars: int
    bits_per_char: float | None
    pending_chars: int
    """Text received but not yet read (an unfinished word or line)."""
    pending_bytes: int
    """Bytes received that do not yet make a whole UTF-8 character."""
    requests: int
    memory: MemoryInfo
    created: float
    last_used: float
    compressed_memory: CompressedInfo | None = None
    """A compressive model's (cmem_len > 0) second memory; absent otherwise."""


class Deleted(Answer):
    id: str
    object: Literal["session"]
    deleted: bool


class TokenLogprob(Answer):
    token: str
    logprob: float | None
    """None for a token nothing scored (a document's first)."""


class TextRead(Answer):
    """POST /v1/sessions/{id}/text."""

    id: str
    object: Literal["session.text"]
    tokens: int
    scored: int
    nll: float
    session: SessionInfo
    logprobs: list[TokenLogprob] | None = None
    """With ``logprobs``: each token read and its log-prob; absent otherwise."""


class Generation(Answer):
    """POST /v1/sessions/{id}/generate."""

    id: str
    object: Literal["session.generation"]
    text: str
    tokens: int
    finish_reason: str
    session: SessionInfo
    logprobs: list[TokenLogprob] | None = None


class GenerationChunk(Answer):
    """POST /v1/sessions/{id}/generate with ``stream``: a piece of text, or (the last) the finish reason and the
    session."""

    text: str
    finish_reason: str | None = None
    session: SessionInfo | None = None


# -- completions -------------------------------------------------------------------------------------------------

class Logprobs(Answer):
    """OpenAI's ``logprobs`` block (``txl.serve.openai.logprob_block``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class Choice(Answer):
    text: str
    index: int
    logprobs: Logprobs | None
    finish_reason: str | None


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(Answer):
    """POST /v1/completions (OpenAI's ``text_completion``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    session: SessionInfo | None = None
    """With ``session``: the session continued."""


class CompletionChunk(Answer):
    """POST /v1/completions with ``stream``: one chunk; the last with choices has the finish reason. With
    ``stream_options.include_usage`` every chunk has ``usage`` (null) and one more chunk ends the stream,
    ``choices: []`` and the usage, as OpenAI streams."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


# -- tokenizer ---------------------------------------------------------------------------------------------------

class Tokenized(Answer):
    """POST /tokenize (vLLM's)."""

    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(Answer):
    prompt: str


class TokenizerInfo(Answer):
    """GET /tokenizer_info (vLLM's): what lm-evaluation-harness's remote tokenizer reads."""

    tokenizer_class: str
    level: str
    vocab_size: int
    eos_token: str | None
    eos_token_id: int | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    model_max_length: int | None
    chat_template: str | None


def stream_of(chunk: type[Answer]) -> dict:
    """A route's streamed answer (``stream``: server-sent events of ``chunk``), for /openapi.json beside its JSON."""
    return {200: {"content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}},
                  "description": f"The answer; with stream, server-sent events: data: {chunk.__name__} each (or a "
                                 "StreamError), then data: [DONE]"}}


STREAMED = (GenerationChunk, CompletionChunk, StreamError)
"""The models of streamed chunks: no route returns them whole, so /openapi.json lists them beside the others."""

ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 404, 413, 415, 422, 429, 503, 507)}
"""The error answers every model route may give, for /openapi.json."""
