"""Streaming detokenisation: generated ids become text as they come (``Tokenizer.stream()``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    @property
    def level(self) -> str: ...
    def decode(self, ids: Sequence[int]) -> str: ...


CONTEXT = 8
"""Ids of the text being continued that a stream decodes its first text after: enough for a detokeniser's rules
(a space before a word, WikiText's ``@-@`` joins)."""


class TextStream:
    """Turns ids into text as they are generated: ``push(id)`` returns the text to show now.

    Decoding is not token-local (WikiText's ``@-@`` joins its neighbours, a byte may be half a
    character), so the output is decoded again and only text that has become stable is shown: the
    text before the last token, without a trailing replacement character of an unfinished UTF-8
    sequence. Shown text cannot be taken back: when a new token changes text already shown (rare
    detokeniser rules), decoding restarts at the token being shown, after a space for words, so the
    streamed text can differ from ``tokenizer.decode(ids)`` in spacing there; ``decode`` stays exact.
    """

    def __init__(self, tokenizer: _Decoder, context: Sequence[int] = ()) -> None:
        """``context``: ids already shown (the text being continued; its last ``CONTEXT`` are read), so that the
        first text shown is what the new ids add to it (for words: a space before the first word)."""
        self.tokenizer, self.ids = tokenizer, [int(i) for i in list(context)[-CONTEXT:]]
        self.shown = tokenizer.decode(self.ids) if self.ids else ""
        self.base, self.prefix = 0, ""  # the current run decodes ids[base:], after the text prefix

    def _emit(self, end: int, *, final: bool = False) -> str:
        text = self.prefix + (self.tokenizer.decode(self.ids[self.base:end]) if end > self.base else "")
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.shown):  # the new token changed shown text: start a new run
            self.base = end - 1
            self.prefix = self.shown + (" " if self.tokenizer.level == "word" else "")
            return self._emit(end, final=final)
        new, self.shown = text[len(self.shown):], text
        return new

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(len(self.ids) - 1)

    def finish(self) -> str:
        return self._emit(len(self.ids), final=True)
