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


def model_card(name: str) -> dict:
    return {"id": name, "object": "model", "owned_by": "txl", "created": 0}


def model_list(name: str) -> dict:
    return {"object": "list", "data": [model_card(name)]}


def choice(text: str, finish: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def usage(out: dict) -> dict:
    p, c = len(out["prompt_ids"]), len(out["ids"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def token_starts(text: str, tokens: list[str], *, words: bool, eos: str | None = None) -> list[int]:
    """Where each token's piece of ``text`` starts: OpenAI's ``text_offset``, a token owning the space before it
    (``[0, 2, 8]`` for ``to hello ,``). Char and byte tokens are pieces of the text in order (their lengths
    summed). ``words``: the tokens are words cut at white space, ``eos`` (the end-of-line symbol) a line break; a
    word not found as written (``<unk>``, a lower-cased word) stands for the run of non-space characters there,
    WikiText's ``@-@`` for the ``-`` it was made of."""
    starts, pos = [], 0
    for token in tokens:
        starts.append(pos)
        if not words:
            pos += len(token)
        elif token == eos:
            line_end = text.find("\n", pos)
            pos = len(text) if line_end < 0 else line_end + 1
        else:
            while pos < len(text) and text[pos].isspace() and not (eos is not None and text[pos] == "\n"):
                pos += 1
            form = token[1] if len(token) == 3 and token[0] == token[2] == "@" else token
            if text.startswith(form, pos):
                pos += len(form)
            else:
                while pos < len(text) and not text[pos].isspace():
                    pos += 1
    return starts


def logprob_block(out: dict, *, logprobs: int | None, echo: bool, token_text: Callable[[int], str],
                  start: int = 0) -> dict | None:
    """OpenAI's ``logprobs``: tokens, their log-probs (None for an unscored one: a document's first token), the
    top alternatives at each (a dict of ``logprobs`` most likely tokens' texts to their log-probs, the token
    itself added where it is not among them, as OpenAI and vLLM do; None for an unscored token; the field is
    None for ``logprobs`` 0) and each token's text offset, its position in the choice's text (from ``start``).

    The positions are ``out["starts"]`` (where each generated token starts in the generated text, as the engine
    reports it) and with ``echo`` ``out["prompt_starts"]`` (``token_starts`` of the prompt) before them, the
    generated text following the prompt's; a token without them is placed at the end of the one before."""
    if logprobs is None:
        return None
    ids, lps = list(out["ids"]), list(out["logprobs"])
    tops: list[dict | None] = [dict(t) for t in out["top_logprobs"]]
    starts = out.get("starts")
    if echo:
        unscored = len(out["prompt_ids"]) - len(out["prompt_logprobs"])
        ids = list(out["prompt_ids"]) + ids
        lps = [None] * unscored + list(out["prompt_logprobs"]) + lps
        prompt_tops = [{token_text(i): v for i, v in zip(*top)} for top in out.get("prompt_top_logprobs", [])]
        tops = [None] * unscored + (prompt_tops or [{} for _ in out["prompt_logprobs"]]) + tops
        if starts is not None and out.get("prompt_starts") is not None:
            starts = list(out["prompt_starts"]) + [len(out["prompt_text"]) + s for s in starts]
        else:
            starts = None
    texts = [token_text(t) for t in ids]
    if logprobs:
        for text, lp, top in zip(texts, lps, tops):
            if top is not None and lp is not None:
                # The token's own log-prob, as token_logprobs has it (one computation, so a greedy token's equals
                # the dict's largest value exactly: lm-evaluation-harness compares them).
                top[text] = lp
    if starts is not None:
        offsets = [start + s for s in starts]
    else:
        offsets = [start + s for s in token_starts("", texts, words=False)]
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops if logprobs else None,
            "text_offset": offsets}


def completion(outs: list[dict], *, cid: str, created: int, model: str, texts: list[str],
               logprobs: list[dict | None]) -> dict:
    """The whole answer of a completion: one choice per prompt (``texts``: the prompt too when echoed), the
    usage summed over them."""
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for out in outs:
        for k, v in usage(out).items():
            total[k] += v
    session = outs[0].get("session") if len(outs) == 1 else None
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice(t, finish_reason(o["finish_reason"]), lp, i)
                        for i, (o, t, lp) in enumerate(zip(outs, texts, logprobs))],
            "usage": total, **({"session": session} if session else {})}


class Chunks:
    """The chunks of one streamed completion, each with the logprobs of the tokens its text covers: a token goes
    out with the first chunk whose text reaches the end of the token's own; the last chunk ('done') carries the
    finish reason, the tokens left and the usage. 'token' events (id, log-prob, top, the length of the text
    shown once it was pushed: each token as drawn, before any text it releases) make no chunk (None). With
    ``include_usage`` the usage follows in a chunk of its own, ``choices: []`` (OpenAI's ``stream_options``).

    A token's text is known to be complete when the next token is pushed: the text stream shows the text
    before the last token only (``TextStream``: decoding is not token-local), so the end the next token
    reports is this one's (the last token's: the end reported when the stream finished); text held back for a
    stop text goes out later, and its tokens with it."""

    def __init__(self, *, cid: str, created: int, model: str, logprobs: int | None,
                 token_text: Callable[[int], str], include_usage: bool = False) -> None:
        self.base: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model}
        self.include_usage = include_usage
        if include_usage:  # OpenAI's shape: every chunk has the field, null but in the last
            self.base["usage"] = None
        self.logprobs, self.token_text = logprobs, token_text
        self.drawn: list[tuple[int, float, dict, float]] = []
        self.starts: list[int] = []  # where each drawn token's text starts in the generated text
        self.sent = 0  # tokens whose logprobs went out
        self.text = 0  # characters streamed
        self.offset = 0  # where the generated text starts in the choice's (after an echoed prompt)

    def _block(self, last: bool) -> dict | None:
        n = self.sent
        while n < len(self.drawn) and (last or self.drawn[n][3] <= self.text):
            n += 1
        ids, lps, tops, _ = zip(*self.drawn[self.sent:n]) if n > self.sent else ((), (), (), ())
        out = {"ids": list(ids), "logprobs": list(lps), "top_logprobs": list(tops), "starts": self.starts[self.sent:n]}
        block = logprob_block(out, logprobs=self.logprobs, echo=False, token_text=self.token_text, start=self.offset)
        self.sent = n
        return block

    def __call__(self, kind: str, data: Any) -> dict | list[dict] | None:
        if kind == "token":
            if self.drawn:  # the previous token's text ends where the text shown now ends
                self.drawn[-1] = (*self.drawn[-1][:3], data[3])
            if data[0] is not None:  # (None, ..., end): the stream finished, the last token's text ends there
                self.drawn.append((*data[:3], float("inf")))
                self.starts.append(data[3])  # the text before it: where its own starts
            return None
        if kind == "text":
            self.text += len(data)
            return {**self.base, "choices": [choice(data, None, self._block(False))]}
        if kind == "echo":  # the prompt, echoed before the continuation: its tokens were read, not drawn
            block = logprob_block({**data, "ids": [], "logprobs": [], "top_logprobs": [], "starts": []},
                                  logprobs=self.logprobs, echo=True, token_text=self.token_text)
            self.offset = len(data["text"])
            return {**self.base, "choices": [choice(data["text"], None, block)]}
        last = {**self.base, "choices": [choice("", finish_reason(data["finish_reason"]), self._block(True))]}
        if not self.include_usage:
            return last
        return [last, {**self.base, "choices": [], "usage": usage(data)}]  # the usage in a chunk of its own
