"""The OpenAI formats: a generation's result as a ``text_completion`` (whole or as stream chunks), its
``logprobs`` block and ``usage``; the model list. Pure functions of plain data: no engine, no HTTP.

A generation's result (``out``) is the engine's dict: ``ids``, ``logprobs``, ``top_logprobs``, ``text``,
``finish_reason``, and for a completion ``prompt_ids``/``prompt_logprobs`` (the prompt's tokens and the
log-probs of those that are scored: all but the first of a document).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FINISH = {"cancelled": "length"}
"""The engine's finish reasons OpenAI has no word for."""


def finish_reason(reason: str) -> str:
    return FINISH.get(reason, reason)


def model_list(name: str) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "txl", "created": 0}]}


def choice(text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}


def usage(out: dict) -> dict:
    p, c = len(out["prompt_ids"]), len(out["ids"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def logprob_block(out: dict, *, logprobs: int | None, echo: bool, token_text: Callable[[int], str]) -> dict | None:
    """OpenAI's ``logprobs``: tokens, their log-probs (None for an unscored one: a document's first token),
    the top alternatives (``logprobs`` of them; None for the prompt's) and each token's text offset."""
    if logprobs is None:
        return None
    ids, lps, tops = list(out["ids"]), list(out["logprobs"]), list(out["top_logprobs"])
    if echo:
        unscored = len(out["prompt_ids"]) - len(out["prompt_logprobs"])
        ids = list(out["prompt_ids"]) + ids
        lps = [None] * unscored + list(out["prompt_logprobs"]) + lps
        tops = [None] * len(out["prompt_ids"]) + tops
    texts = [token_text(t) for t in ids]
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops if logprobs else None,
            "text_offset": offsets}


def completion(out: dict, *, cid: str, created: int, model: str, text: str, logprobs: dict | None) -> dict:
    """The whole answer of a completion (``text``: the prompt too when echoed)."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice(text, finish_reason(out["finish_reason"]), logprobs)], "usage": usage(out),
            **({"session": out["session"]} if out.get("session") else {})}


def chunk(kind: str, data: Any, *, cid: str, created: int, model: str,
          logprobs: Callable[[dict], dict | None]) -> dict:
    """One streamed chunk: a piece of text, or (``kind`` 'done') the finish reason, logprobs and usage."""
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}
    if kind == "text":
        return {**base, "choices": [choice(data, None)]}
    return {**base, "choices": [choice("", finish_reason(data["finish_reason"]), logprobs(data))],
            "usage": usage(data)}
