"""The request logic: what a request does to its session, as a generator of units the scheduler runs.

Reading text into a session (``read_ids``, ``read_text``, ``read_tail``, ``read_prompt``) and continuing it
(``generate``) yield units of model work (``txl.serve.runner.Unit``) and receive their results; the session's
memory goes in with a unit and comes out with its result, and the session (``SessionState``) holds it between
requests. Generation chooses tokens as `txl generate` does (``txl.decoding``: its ``Picker`` and ``StopText``);
what it generates is then read into the session like text.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from txl.data.tokenizer.stream import TextStream
from txl.decoding import Picker, StopText
from txl.serve.runner import Model, Result, Unit
from txl.serve.session import ClientError, SessionState, take_text

if TYPE_CHECKING:
    from txl.serve.scheduler import Job

__all__ = ["Kept", "Requests"]


@dataclass
class Kept:
    """A generation's rows kept in its session (``SessionState.generation``) for the generation that follows."""

    memory: torch.Tensor
    """(L, m, d): the session's memory rows, then every token the generation read."""
    kv: tuple[torch.Tensor, torch.Tensor] | None
    """Their keys and values (L, m, H, D) each (None without a cache)."""
    inputs: int
    """How many of the session's tokens the rows read (m less the memory's rows)."""
    session_memory: torch.Tensor | None
    """The session's memory they started from (the same object: no segment ended since)."""
    n_tokens: int
    """The session's token count then (anything read since makes the rows stale)."""


class Requests:
    """The work of requests, run by the scheduler's worker; the engine (``txl.serve.engine.Engine``) is one."""

    m: Model
    tokenizer: object
    metrics: object
    pipelined: bool = True
    """Generation launches step t + 1 before the host reads step t's token (``generate``); False: the host reads
    each token before the next step is launched (the tests' reference)."""

    def read_ids(self, state: SessionState, ids: list[int], generated: tuple[list[float], Result] | None = None,
                 *, top: int = 0, tops: list | None = None) -> Generator[Unit, Result, list[float]]:
        """Read ``ids`` into the session; the log-probs of those that are scored (all but a document's first
        token when there is no context token).

        ``generated``: ``ids`` were just sampled from the session by ``generate``, which gives their log-probs and
        its last result (its batch row holds the hidden states of every token it read). Where the reading
        context equals the generation's (``Model.generation_reads_alike``), the tokens up to the end of the
        unfinished segment are not read again: their log-probs are the generation's, and the memory at the
        segment's end (when they complete it) is the generation's rows up to there. Tokens past that boundary
        are read (the generation showed them more than the reading's memory).

        ``top``: the ``top`` most likely tokens at each scored position are appended to ``tops`` (ids, log-probs),
        one entry per log-prob returned (a completion's echoed prompt; not with ``generated``).
        """
        S = self.m.segment_len
        state.generation = None  # what is read now was not read by the last generation
        toks = state.tokens + ids
        offset = len(state.tokens)  # toks[offset:] are new; label j is toks[j + 1]
        out: list[float] = []
        unfinished = True  # the unfinished segment is read again from the boundary
        if generated is not None and self.m.generation_reads_alike and offset:
            known, last = generated
            if len(toks) - 1 < S:  # all in the unfinished segment: nothing to compute
                out, unfinished = list(known), False
            elif self.m.cmem_len:  # a compressive model compresses at the boundary: the segment is read again
                pass
            else:  # the segment completes: its memory from the generation's rows, as its reading would keep it
                rows, b = last.row
                memory, _ = rows.take(b)  # (L, m, d): the memory rows, then every token the generation read
                end = (0 if state.memory is None else state.memory.size(1)) + S
                keep = min(self.m.mem_len, end)
                state.memory = memory[:, end - keep:end].clone() if keep and state.with_memory else None
                out = list(known[:S - offset + 1])  # labels toks[offset..S]
                toks, offset = toks[S:], 0
        while len(toks) - 1 >= S:  # a complete segment: S labels, its memory kept
            r = yield Unit("score", toks[:S], state.memory, toks[1:S + 1], with_memory=state.with_memory, top=top,
                           compressed=state.compressed)
            out.extend(r.logprobs[max(offset - 1, 0):])
            if top:
                tops.extend(r.top[max(offset - 1, 0):])
            state.memory, state.compressed = r.memory, r.compressed
            toks, offset = toks[S:], max(offset - S, 0)
        first = max(offset - 1, 0)
        if unfinished and len(toks) >= 2 and first <= len(toks) - 2:  # read again from the boundary
            r = yield Unit("score", toks[:-1], state.memory, toks[1:], with_memory=state.with_memory, top=top,
                           compressed=state.compressed)
            out.extend(r.logprobs[first:])
            if top:
                tops.extend(r.top[first:])
        state.tokens = toks
        state.n_tokens += len(ids)
        state.n_scored += len(out)
        state.nll -= sum(out)
        if self.metrics is not None:
            self.metrics.tokens_read.inc(len(ids))
        return out

    def read_text(self, state: SessionState, data: str | bytes, *, final: bool, top: int = 0,
                  tops: list | None = None) -> Generator[Unit, Result, tuple[list[int], list[float]]]:
        ids, text, tail, raw = take_text(state, data, self.tokenizer, final=final)
        lps = yield from self.read_ids(state, ids, top=top, tops=tops)
        state.tail, state.raw = tail, raw
        state.chars += len(text)
        return ids, lps

    def read_tail(self, state: SessionState, *, top: int = 0,
                  tops: list | None = None) -> Generator[Unit, Result, tuple[list[int], list[float]]]:
        """Read the session's unfinished line as it stands (a prompt's end, or the text a generation continues):
        its ids and the log-probs of those scored."""
        if state.raw:
            raise ClientError(400, "session", "the session holds an unfinished UTF-8 character: send its "
                              "remaining bytes first")
        if not state.tail:
            return [], []
        try:
            ids = [int(i) for i in self.tokenizer.encode_prompt(state.tail)]
        except ValueError as err:
            raise ClientError(400, "text", str(err)) from None
        state.chars += len(state.tail)
        state.tail = ""
        lps = yield from self.read_ids(state, ids, top=top, tops=tops)
        return ids, lps

    def read_prompt(self, state: SessionState, text: str, *, top: int = 0,
                    tops: list | None = None) -> Generator[Unit, Result, tuple[list[int], list[float]]]:
        """Read a completion's prompt: whole text, its last line (a word-level model's last word) read as it
        stands instead of held back for more text, as a session's text is (``top``, ``tops``: ``read_ids``')."""
        ids, lps = yield from self.read_text(state, text, final=False, top=top, tops=tops)
        more, more_lps = yield from self.read_tail(state, top=top, tops=tops)
        return ids + more, lps + more_lps

    def generate(self, state: SessionState, *, max_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: int | None, stop: list[str], job: Job, on_text: Callable[[str], None] | None = None,
                 top_logprobs: int = 0, repetition_penalty: float = 1.0, stop_tokens: Sequence[int] = (),
                 on_token: Callable[..., None] | None = None) -> Generator[Unit, Result, dict]:
        """Continue the session: sample up to ``max_tokens`` tokens, then read them into it. The text is what
        the tokens add to the session's text (for words: after a space, unless a line just ended).

        Tokens are chosen as `txl generate` chooses them (``txl.decoding.Picker``: a seed is row 0's, the
        repetition penalty counts the tokens since the session's last segment boundary, the memory's are not
        kept), on the model's device by the runner (``txl.serve.runner.draw``): the host reads each token's id and
        log-prob with one small copy a step (all after the last step when no stop rule or stream needs them
        sooner), and the next step's input never leaves the device. With ``pipelined`` (the default) step t + 1 is
        launched before the host reads step t's token, so the device never waits for the host's stop checks and
        streaming; a generation that a stop text or stop token ends at step t has then computed one step more,
        whose token is dropped and whose row is never kept (``_kept``): the session ends as unpipelined;
        ``stop`` texts are found by ``txl.decoding.StopText``, which holds back what may become one.
        ``on_token(id, log-prob, top alternatives, end)`` sees each token as it is drawn, before the text its push
        releases goes out (``end``: the length of the text then, held text included), and
        ``on_token(None, None, None, end)`` once the text stream has finished.
        """
        yield from self.read_tail(state)  # an unfinished line: generation continues it
        if not state.tokens:
            raise ClientError(400, "session", "the session has read no text yet: give a prompt or read some text "
                              "first (generation continues a text)")
        try:
            pick = Picker(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                          seeds=None if seed is None else [seed], stop_tokens=stop_tokens, top_logprobs=top_logprobs,
                          vocab_size=self.m.model.config.vocab_size, device=self.m.device)
        except ValueError as err:
            raise ClientError(400, "stop_token_ids", str(err)) from None
        pick.see(torch.tensor([state.tokens], device=self.m.device))  # drawn on the device, by the runner
        stream = TextStream(self.tokenizer, context=state.tokens)
        texts = StopText(stop)
        produced: list[int] = []
        chosen: list[float] = []
        tops: list[dict[str, float]] = []
        finish = "length"
        kept, start_memory = state.generation, state.memory
        if max_tokens:
            if (kept is not None and kept.session_memory is state.memory and kept.n_tokens == state.n_tokens
                    and kept.inputs == len(state.tokens) - 1):
                # The last generation's rows read every token but its last one, with the same memory and the same
                # context a prefill would give them: one step from them, batched with the others' steps.
                r = yield Unit("step", state.tokens[-1:], kept.memory, kv=kept.kv, compressed=state.compressed,
                               pick=pick)
            else:
                r = yield Unit("prefill", state.tokens, state.memory, compressed=state.compressed, pick=pick)

        def take(drawn: tuple) -> tuple[int, list | None]:
            """The host reads a drawn token (its id, its log-prob, its alternatives) into the generation's lists."""
            token, logprob, top = drawn[0].get(drawn[1])
            produced.append(token)
            chosen.append(logprob)
            if top is not None:
                tops.append({self.tokenizer.token_text(t): v for t, v in top})
            return token, top

        # Without a stop rule or a stream nothing needs a token before the generation ends: the steps run on, each
        # reading the last one's token on the device (``Unit.after``; its ``inputs`` unknown here, -1), and the host
        # reads them all after the last step, never waiting for the device between steps.
        deferred = not stop and not pick.stop_set and on_text is None and on_token is None
        pending: list[tuple] = []
        for i in range(max_tokens):
            if job.cancelled:
                finish = "cancelled"
                break
            more = i + 1 < max_tokens  # the token limit is known ahead: the last token launches no step
            if deferred:
                pending.append(r.drawn)
                if more:
                    r = yield Unit("step", [-1], row=r.row, pick=pick, after=r.drawn)
                continue
            # Pipelined: step i + 1, whose input is token i on the device, is launched before the host reads token
            # i (the scheduler runs it, with the other rows' steps, before this generator resumes), so its copy is
            # read while the device computes the next step. If token i stops the generation, that step is dropped.
            ahead = (yield Unit("step", [-1], row=r.row, pick=pick, after=r.drawn)) if more and self.pipelined \
                else None
            token, top = take(r.drawn)  # drawn on the device by the runner; the host reads the id and its log-prob
            stopped = texts.push(stream.push(token))
            if on_token is not None:  # before its text goes out; ``end``: where the text pushed so far ends
                on_token(token, chosen[-1], tops[-1] if top is not None else {}, len(texts.text))
            if stopped or token in pick.stop_set:
                finish = "stop"
                break
            piece = texts.show()
            if piece and on_text is not None:
                on_text(piece)
            if more:  # its input stays on the device
                r = ahead if ahead is not None else (yield Unit("step", [token], row=r.row, pick=pick, after=r.drawn))
        for drawn in pending:  # deferred: no stop text nor token, so nothing stops them
            texts.push(stream.push(take(drawn)[0]))
        if not texts.stopped:  # the last token's text (a stop token's too)
            if texts.push(stream.finish()):
                finish = "stop"
        if on_token is not None and produced:  # the end of the last token's text, now that the stream is finished
            on_token(None, None, None, len(texts.text))
        piece = texts.finish()
        if piece and on_text is not None:
            on_text(piece)
        shown = texts.text
        if self.metrics is not None:
            self.metrics.tokens_generated.inc(len(produced))
        # What was generated becomes part of the session, read as text is (its scores as `txl score` gives).
        yield from self.read_ids(state, produced, (chosen, r) if produced else None)
        if produced and state.memory is start_memory:  # no segment ended: the rows stay valid for the next one
            state.generation = self._kept(r, state, start_memory)
        state.generated += len(produced)
        state.chars += len(self.tokenizer.decode(produced)) if produced else 0
        return {"text": shown, "ids": produced, "logprobs": chosen, "top_logprobs": tops, "finish_reason": finish}

    def _kept(self, last: Result, state: SessionState, start_memory: torch.Tensor | None) -> Kept:
        """The rows a generation keeps in its session: its row's memory, keys and values over the memory it started
        from and every token of the session but the last (which no step has read), copied out of the batch.

        A row may have read more: a step launched before the host read the token that stopped the generation (a
        pipelined stop, or a cancelled request's last step). In the slots (``txl.serve.slots``) such a step wrote its
        column into the same seat as the kept result's; in a ``Rows`` batch it appended past the kept result's views.
        Either way its rows are the newest, after the ones kept, and every older row is as an unpipelined run left
        it (the memory keeps every row read while generating: nothing slid out), so dropping them leaves exactly the
        rows an unpipelined run keeps."""
        memory, kv = self.m.take(last.row)  # (L, m', d), (L, m' (+ C), H, D) each
        m0 = 0 if start_memory is None else start_memory.size(1)
        inputs = len(state.tokens) - 1  # no segment ended: the session's tokens are the prompt and the generated
        extra = memory.size(1) - (m0 + inputs)
        if extra < 0:
            raise RuntimeError(f"a generation's row holds {memory.size(1)} rows, fewer than the {m0 + inputs} it read")
        if extra:
            memory = memory[:, :memory.size(1) - extra]  # (L, m0 + inputs, d)
            kv = None if kv is None else tuple(t[:, :t.size(1) - extra] for t in kv)  # (L, m0 + inputs (+ C), H, D)
        return Kept(memory, kv, inputs, start_memory, state.n_tokens)
