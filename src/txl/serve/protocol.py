"""What clients send and what errors say: pydantic models of every request body and query, and the one
way they are validated.

The one validation style: every body and query is a pydantic model (``extra="forbid"`` and strict types
for bodies, so 'yes' is not a bool and 5 is not a prompt), read by ``parse``. A wrong type or an unknown
field is a 422, a value out of range (``Range`` errors raised by the validators below) or a missing
required field a 400; when a request holds both, the 422 is reported (types are checked before ranges).
Limits that come from the server's config (``serve.max_tokens``) reach the validators through pydantic's
validation context. New endpoints put their models here, next to these.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from txl.config import check_sampling
from txl.serve.session import ClientError

RANGE = "value_out_of_range"
"""The pydantic error type of a value of the right type but out of range: answered 400."""


def out_of_range(reason: str) -> PydanticCustomError:
    return PydanticCustomError(RANGE, reason)


class Body(BaseModel):
    """A JSON request body: unknown fields and loose types are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Query(BaseModel):
    """Query parameters: strings converted as pydantic does ('true', '1', 'yes' ... for a bool); others ignored."""

    model_config = ConfigDict(extra="ignore")


# -- sessions ------------------------------------------------------------------------------------------------

class CreateSession(Body):
    memory: bool = True
    """False: each segment is read alone (the page's 'without memory' view)."""


class TextBody(Body):
    """POST /v1/sessions/{id}/text with ``Content-Type: application/json``."""

    text: str
    logprobs: bool = False
    final: bool = False


class TextQuery(Query):
    """POST /v1/sessions/{id}/text with a raw body (text/plain, application/octet-stream): flags in the query."""

    logprobs: bool = False
    final: bool = False


TEXT_TYPES = ("application/json", "text/plain", "application/octet-stream")
"""The content types ``/text`` reads; a request without one is read as application/octet-stream (RFC 9110
8.3); others (a form, XML) are refused with 415, since text once read cannot be taken back. A raw body is UTF-8
(perhaps cut mid-character: the rest comes with the next piece), or text/plain in the charset it declares
(``charset=latin-1``: read whole). JSON is application/json in UTF-8 at every endpoint (``deps.read_json``)."""


# -- generation ----------------------------------------------------------------------------------------------

class Sampling(Body):
    """The sampling settings of a generation, as `txl generate` takes them (vLLM's names for the two OpenAI
    lacks: ``repetition_penalty``, ``stop_token_ids``). Their rule is ``txl.config.check_sampling``, the one
    every command applies; what is the server's own (``serve.max_tokens``, at most 4 stop texts) is here."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int, info: ValidationInfo) -> int:
        limit = (info.context or {}).get("max_tokens")
        if v < 0:
            raise out_of_range(f"must be >= 0, got {v}")
        if limit is not None and v > limit:
            raise out_of_range(f"must be <= {limit} (serve.max_tokens), got {v}")
        return v

    @field_validator("temperature", "top_p", "top_k", "repetition_penalty")
    @classmethod
    def _sampling(cls, v: float, info: ValidationInfo) -> float:
        if info.field_name == "temperature" and v == float("inf"):  # JSON's Infinity: no distribution left
            raise out_of_range("must be a finite number >= 0 (0: greedy)")
        try:
            check_sampling(**{info.field_name: v})
        except ValueError as err:
            raise out_of_range(str(err)) from None
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < 2**63:
            raise out_of_range(f"must be in 0..2**63-1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stop = [v] if isinstance(v, str) else list(v or [])
        if len(stop) > 4 or any(not s or len(s) > 256 for s in stop):
            raise out_of_range("at most 4 stop texts, each 1 to 256 characters")
        return v

    @property
    def stop_texts(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class GenerateBody(Sampling):
    """POST /v1/sessions/{id}/generate."""

    logprobs: bool = False


class StreamOptions(Body):
    """A streamed completion's ``stream_options``, as OpenAI's spec has them."""

    include_usage: bool = False
    """The usage in a last chunk of its own (``choices: []``) before ``[DONE]``, every other chunk with
    ``usage: null``; without it, no chunk has a usage, as OpenAI streams."""
    include_obfuscation: bool = False
    """Accepted for OpenAI's clients: txl's chunks carry no obfuscation field either way."""


NULLABLE = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "logprobs", "echo",
            "n", "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "stream_options", "user",
            "model")
"""The completion fields OpenAI's spec lets a client send as null (``"max_tokens": null``): null is the default."""

Prompt = str | list[int]
"""One prompt: text, or token ids (read exactly as given: the first is the context of the rest)."""


class CompletionBody(Sampling):
    """POST /v1/completions (OpenAI's legacy completions; the fields it accepts but does not support are
    refused with 400 when set to anything but their neutral value). ``prompt`` is a text, a list of texts, a
    list of token ids, or a list of such lists (a batch: one choice each, at most serve.max_batch)."""

    prompt: str | list[str] | list[int] | list[list[int]] = ""
    model: str | None = None
    logprobs: int | None = None
    echo: bool = False
    session: str | None = None
    n: int = 1
    best_of: int | None = None
    user: str | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULLABLE)}
        return data

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list, info: ValidationInfo) -> str | list:
        limit = (info.context or {}).get("max_batch")
        if isinstance(v, list):
            if not v:
                raise out_of_range("is an empty list: give a text, texts, token ids or lists of token ids")
            batch = 1 if isinstance(v[0], int) else len(v)
            if limit is not None and batch > limit:
                raise out_of_range(f"at most {limit} prompts in one request (serve.max_batch), got {batch}")
            if any(isinstance(p, list) and not p for p in v):
                raise out_of_range("holds an empty list of token ids")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= 5:
            raise out_of_range(f"must be in 0..5, got {v}")
        return v

    @field_validator("n", "best_of")
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise out_of_range("only 1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _zero(cls, v: float) -> float:
        if v != 0:
            raise out_of_range("is not supported (only 0)")
        return v

    @field_validator("logit_bias", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise out_of_range("is not supported")
        return v

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts of the batch (one for a text or a list of token ids)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


# -- the tokenizer (vLLM's /tokenize, /detokenize) ------------------------------------------------------------

class TokenizeBody(Body):
    """POST /tokenize: a text's token ids, as a completion's text prompt is read (no context token)."""

    prompt: str
    model: str | None = None
    add_special_tokens: bool = False
    """Accepted for vLLM's clients; txl's tokenizers add no special token to a prompt either way."""
    return_token_strs: bool = False


class DetokenizeBody(Body):
    """POST /detokenize: the text of token ids."""

    tokens: list[int]
    model: str | None = None


# -- reading and checking -------------------------------------------------------------------------------------

def decode_json(body: bytes) -> Any:
    """The JSON value of a request body, or a 400 naming what is wrong with it (never a 500: a body nested
    deeper than the decoder's recursion limit is refused as such, before anything is logged)."""
    try:
        return json.loads(body)
    except UnicodeDecodeError:
        raise ClientError(400, "body", "the body is not UTF-8") from None
    except json.JSONDecodeError as err:
        raise ClientError(400, "body", f"malformed JSON ({err.msg} at character {err.pos})") from None
    except RecursionError:
        raise ClientError(400, "body", "the JSON is nested too deeply") from None


def parse(kind: type[BaseModel], data: Any, *, context: dict[str, Any] | None = None) -> BaseModel:
    """``data`` (a decoded JSON body, or a query's dict of strings) as a ``kind``, or the ClientError of its
    first error (the first type error when there is one)."""
    if issubclass(kind, Body) and not isinstance(data, dict):
        raise ClientError(422, "body", "must be a JSON object")
    try:
        return kind.model_validate(data, context=context)
    except ValidationError as err:
        raise client_error(err.errors()) from None
    except RecursionError:  # a deeply nested value inside a field of type Any
        raise ClientError(400, "body", "the JSON is nested too deeply") from None


_REASONS = {"extra_forbidden": "unknown field", "bool_type": "must be true or false",
            "bool_parsing": "must be true or false", "missing": "is required"}


def client_error(errors: list[dict]) -> ClientError:
    """The ClientError of pydantic's (or FastAPI's) errors: the first type error (422) if any, else the first."""
    e = next((e for e in errors if e.get("type") not in (RANGE, "missing")), errors[0])
    loc = [x for x in e.get("loc", ()) if x not in ("body", "query", "path")]
    # The field, and list positions in it; not pydantic's union tags ('str', 'list[str]').
    field = ".".join([str(loc[0])] + [str(x) for x in loc[1:] if isinstance(x, int)]) if loc else "body"
    kind = e.get("type")
    if kind == "json_invalid":
        return ClientError(400, "body", "malformed JSON")
    reason = _REASONS.get(kind, e.get("msg", "invalid"))
    return ClientError(400 if kind in (RANGE, "missing") else 422, field, reason)
