"""Text generation with the segment-level recurrence cache (Dai et al. 2019, section 3.2).

Shape legend: B batch, T prompt length, N new tokens, V vocabulary, M memory length, d d_model.

Transformer-XL caches the *input* of every layer for the positions it has read (the memory). A
prompt is read segment by segment into that memory; afterwards every new token costs one position:
the model reads a (B, 1) input against the cached memory and the whole context is never re-run. The
paper's evaluation speed-up (up to 1,874 times over the vanilla model, section 4.4) comes from this.
On top of the memory, a ``KVCache`` keeps the memory rows' projected keys and values and the projected
relative encodings ('relative' and 'shaw' attention), so a step projects one position, not M: its
cost grows with M d (attention), not M d^2 (projections).

Memory length for generation (``mem_len``). By default it is ``T + N``: nothing the model has read is
ever dropped, so token-by-token generation gives exactly the distribution of one full forward pass
over the whole text (tests/test_generate.py proves it). The cost of a step then grows linearly with
the context; pass a smaller ``mem_len`` to bound it, and each token attends to the last ``mem_len``
positions (a sliding window, as the paper evaluates with a memory longer than it trains with).
How memory is bounded: with ``mem_len`` given, the memory and its key/value cache hold at most
``mem_len`` positions whatever ``N`` is; without it they grow to ``T + N`` positions, and a call whose
whole context would not fit in the memory available (``context_bytes``) is refused before any work.
``same_length`` is off and ``ext_len`` is 0 while generating: both only make sense for fixed-length
training or evaluation segments. The model's own config is restored after every call.

The memory starts empty (the original PyTorch code), not as the zeros that Hugging Face and the
TensorFlow original attend to at the start of a stream.

Prompts of different lengths are read as one batch, left-padded: the pad positions are masked as keys
(``padding=`` of the model's forward) for as long as they stay in the memory, and relative attention does
not see the shift, so each row is generated exactly as it would be alone (with the default ``mem_len``,
which drops nothing): greedily, and when sampling with ``seed``, which gives row b its own generator seeded
``seed + b`` (row b equals its prompt alone with ``seed=seed + b``). Generation of a row ends at one of
``stop_tokens`` (which is returned) or once
its text contains one of ``stop_strings``; its later places hold ``FINISHED`` (-1), and generation ends
when every row has stopped. ``repetition_penalty`` (CTRL) lowers the scores of tokens already read or
produced.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import torch

from txl import sampling
from txl.evaluate import inference_context
from txl.model import KVCache, Memory, TransformerXL
from txl.model.attention import attn_types, either
from txl.model.kv_cache import weights_version
from txl.model.memory import memory_length
from txl.runtime import compile_model
from txl.sampling import apply_repetition_penalty, sample_next

__all__ = ["FINISHED", "IncrementalDecoder", "generate", "generate_stream", "inference_context"]

FINISHED = -1
"""The id in a row's places after it stopped (at a stop token or stop string)."""


def _positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


class IncrementalDecoder:
    """The state of one generation: the memory of everything read so far.

    ``feed(ids)`` reads (B, T) more tokens, ``segment_len`` at a time, and returns the (B, V)
    log-probabilities of the token that follows them. A (B, 1) feed is one generation step: one
    position against the cached memory. Not a module: it holds no parameters, only the memory (and
    its key/value cache) that the model hands back (the model itself never holds either).
    """

    def __init__(self, model: TransformerXL, *, mem_len: int, segment_len: int = 256, compile: bool = False) -> None:
        self.model = model
        self.forward = compile_model(model, compile)  # the model itself unless compile
        self.mem_len = _positive_int("mem_len", mem_len)
        self.segment_len = _positive_int("segment_len", segment_len)
        self.memory: Memory | None = None
        self.kv_cache: KVCache | None = model.start_kv_cache()
        self.length = 0
        """Tokens read so far."""
        self.memory_padding: torch.Tensor | None = None
        """(B, M) bool, True for memory rows that hold pads; None while the memory holds none."""

    def feed(self, ids: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """Read (B, T) token ids into the memory; return (B, V) float32 log-probs of the next token.

        ``padding``: (B, T) bool, True at pad positions (left padding): no later position attends to them.
        """
        if ids.dim() != 2 or ids.size(1) == 0:
            raise ValueError(f"feed() takes a non-empty (B, T) tensor of token ids, got shape {tuple(ids.shape)}")
        if padding is not None and padding.shape != ids.shape:
            raise ValueError(f"padding has shape {tuple(padding.shape)}, the ids {tuple(ids.shape)}")
        hidden = None
        with inference_context(self.model, mem_len=self.mem_len, same_length=False, ext_len=0) as context:
            if self.kv_cache is not None and self.kv_cache.weights_version not in (None, weights_version(self.model)):
                self.kv_cache = KVCache()  # the weights changed between feeds: rebuild from the memory
            for start in range(0, ids.size(1), self.segment_len):
                segment = ids[:, start:start + self.segment_len]  # (B, S)
                rows = self._padding(segment, None if padding is None else padding[:, start:start + self.segment_len])
                out = self.forward(segment, memory=self.memory, return_log_probs=False, kv_cache=self.kv_cache,
                                   context=context, padding=rows)
                self.memory, self.kv_cache, hidden = out.memory, out.kv_cache, out.hidden  # hidden: (B, S, d)
                # The memory keeps the last M rows of [memory; segment]: so does its padding.
                m = memory_length(self.memory)
                self.memory_padding = rows[:, rows.size(1) - m:] if rows is not None and m else None
            # Only the last position is needed: score it alone, not the (B, T, V) of the whole prompt.
            log_probs = self.model.softmax.log_prob(hidden[:, -1])  # (B, V)
        self.length += ids.size(1)
        return log_probs

    def _padding(self, segment: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor | None:
        """(B, M + S) bool over the memory rows and the segment, or None when neither holds a pad."""
        if padding is None and self.memory_padding is None:
            return None
        B, S = segment.shape
        if padding is None:
            padding = torch.zeros(B, S, dtype=torch.bool, device=segment.device)  # (B, S)
        M = memory_length(self.memory)
        memory_padding = self.memory_padding
        if memory_padding is None:
            memory_padding = torch.zeros(B, M, dtype=torch.bool, device=segment.device)  # (B, M)
        rows = torch.cat([memory_padding, padding], dim=1)  # (B, M + S)
        return rows if bool(rows.any()) else None


PromptIds = torch.Tensor | Sequence[int] | Sequence[Sequence[int]]
"""A (B, T) or (T,) tensor, a list of ids, or a list of lists of ids (of any lengths: left-padded)."""


def _as_prompt(prompt_ids: PromptIds, model: TransformerXL) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A (B, T) int64 tensor on the model's device, and its (B, T) bool padding (None when no row is padded)
    from a tensor, a list of ids or lists of ids of any lengths, left-padded to the longest."""
    device = next(model.parameters()).device
    padding = None
    if isinstance(prompt_ids, torch.Tensor):
        prompt = prompt_ids.to(device=device, dtype=torch.long)
    else:
        rows = list(prompt_ids)
        if rows and not isinstance(rows[0], (list, tuple)) and not hasattr(rows[0], "__len__"):
            rows = [rows]
        rows = [list(map(int, r)) for r in rows]
        if any(not r for r in rows):
            raise ValueError("one of the prompts is empty: give every prompt at least one token")
        longest = max((len(r) for r in rows), default=0)
        # Left padding: every row's last token is at the end, where generation continues. The pad id is
        # any valid one (0): no real position attends to it.
        prompt = torch.tensor([[0] * (longest - len(r)) + r for r in rows], dtype=torch.long, device=device)
        if any(len(r) < longest for r in rows):
            padding = torch.tensor([[True] * (longest - len(r)) + [False] * len(r) for r in rows], device=device)
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0)  # (1, T)
    if prompt.dim() != 2 or prompt.numel() == 0:
        raise ValueError(f"the prompt is empty (shape {tuple(prompt.shape)}): give at least one token, "
                         "e.g. the end-of-sentence token to start from nothing")
    vocab = model.config.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise ValueError(f"prompt token id {int(prompt.max()) if int(prompt.max()) >= vocab else int(prompt.min())} "
                         f"is out of range for vocab_size={vocab}; encode with this model's vocabulary")
    return prompt, padding


def check_sampling(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                   repetition_penalty: float = 1.0) -> None:
    """Raise a ValueError naming the bad sampling parameter, before any work is done."""
    _positive_int("max_new_tokens", max_new_tokens, minimum=0)
    sampling.check_sampling(temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty)


def context_bytes(config, batch_size: int, positions: int, element_size: int = 4) -> int:
    """Bytes the generation state takes at ``positions`` positions: every layer's memory rows (B, M, d) and,
    for cacheable attention, their projected keys and values (B, M, H, D) twice."""
    per_layer = config.d_model + (2 * config.n_head * config.d_head if config.attn_type in ("relative", "shaw") else 0)
    return batch_size * positions * config.n_layer * per_layer * element_size


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (a CUDA device's free memory, else the host's available pages); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_whole_context(model: TransformerXL, batch_size: int, prompt_len: int, max_new_tokens: int) -> None:
    param = next(model.parameters())
    need = context_bytes(model.config, batch_size, prompt_len + max_new_tokens, param.element_size())
    free = available_bytes(param.device)
    if free is not None and need > free:
        raise ValueError(f"max_new_tokens={max_new_tokens:,} with the whole context kept (mem_len none) would hold "
                         f"{prompt_len + max_new_tokens:,} positions of memory, about {need / 2**30:,.1f} GiB, more "
                         f"than the {free / 2**30:,.1f} GiB free: give mem_len (e.g. --mem-len 1024, a sliding window "
                         "that bounds the memory) or fewer new tokens")


def generate_stream(model: TransformerXL, prompt_ids: PromptIds, *,
                    max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int | None = None, generator: torch.Generator | None = None,
                    mem_len: int | None = None, segment_len: int = 256, stop_tokens: Sequence[int] = (),
                    stop_strings: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
                    repetition_penalty: float = 1.0, compile: bool = False) -> Iterator[torch.Tensor]:
    """Yield each new token, (B,) int64, as soon as it is drawn.

    The prompt (B, T), or a list of ids, or lists of ids of different lengths (left-padded, see the
    module docstring), is read ``segment_len`` tokens at a time; then each new token is one (B, 1) step
    against the memory. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token.
    Randomness comes only from ``seed`` (row b: a generator seeded ``seed + b``, so each row equals its prompt
    alone with ``seed=seed + b``), or from ``generator``, shared by the rows (neither: torch's global generator).
    ``mem_len`` None keeps the whole context (see the module docstring).
    ``compile`` runs the forward through torch.compile.

    A row stops after producing one of ``stop_tokens``, or once ``decode(its new ids)`` contains one of
    ``stop_strings`` (the caller cuts the text there); its later places are ``FINISHED`` and the stream
    ends when every row has stopped. ``repetition_penalty`` > 1 lowers the scores of tokens already in
    the row (prompt or output; ``txl.sampling.apply_repetition_penalty``). Arguments are checked when this
    is called, not at the first ``next()``.
    """
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty)
    if seed is not None and generator is not None:
        raise ValueError("pass seed or generator, not both")
    if stop_strings and decode is None:
        raise ValueError("stop_strings need decode= (ids -> text), to read the text each row has produced")
    stops = torch.tensor(sorted({int(t) for t in stop_tokens}), dtype=torch.long)
    if stops.numel() and (int(stops.min()) < 0 or int(stops.max()) >= model.config.vocab_size):
        raise ValueError(f"stop_tokens {stops.tolist()} must be ids in 0..{model.config.vocab_size - 1}")
    prompt, padding = _as_prompt(prompt_ids, model)  # (B, T), (B, T) or None
    if padding is not None and not model.encoding.relative:
        raise ValueError("prompts of different lengths need relative positions (attn_type "
                         f"{either(attn_types(relative=True))}): with attn_type={model.config.attn_type!r} left "
                         "padding would shift every position; "
                         "generate for each length separately")
    if mem_len is not None:
        _positive_int("mem_len", mem_len)
    _positive_int("segment_len", segment_len)
    rows = None
    if seed is not None:
        # Row b draws from its own generator, seeded seed + b: it is the row generate(its prompt alone,
        # seed=seed + b) gives, whatever else the batch holds (a shared generator would tie each row's draws to
        # the rows before it), and a prompt repeated in a batch still gets different samples.
        rows = [torch.Generator(prompt.device).manual_seed(int(seed) + b) for b in range(prompt.size(0))]
    if mem_len is None:
        _check_whole_context(model, prompt.size(0), prompt.size(1), max_new_tokens)
    decoder = IncrementalDecoder(model, mem_len=mem_len or prompt.size(1) + max_new_tokens, segment_len=segment_len,
                                 compile=compile)

    B, V = prompt.size(0), model.config.vocab_size
    seen = None
    if repetition_penalty != 1.0:
        real = torch.ones_like(prompt) if padding is None else (~padding).long()  # (B, T): pads are not read
        seen = torch.zeros(B, V, dtype=torch.long, device=prompt.device).scatter_add_(1, prompt, real) > 0  # (B, V)
    stop_ids = stops.to(prompt.device)

    def tokens() -> Iterator[torch.Tensor]:
        if max_new_tokens == 0:
            return
        log_probs = decoder.feed(prompt, padding)  # (B, V)
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)  # (B,)
        produced: list[list[int]] = [[] for _ in range(B)]
        for i in range(max_new_tokens):
            if seen is not None:
                log_probs = apply_repetition_penalty(log_probs, seen, repetition_penalty)
            if rows is None:
                token = sample_next(log_probs, temperature=temperature, top_k=top_k, top_p=top_p,
                                    generator=generator)  # (B,)
            else:
                token = torch.cat([sample_next(log_probs[b:b + 1], temperature=temperature, top_k=top_k,
                                               top_p=top_p, generator=g) for b, g in enumerate(rows)])  # (B,)
            token = token.masked_fill(done, FINISHED)  # (B,)
            yield token
            live = ~done
            if seen is not None:
                seen[live.nonzero().squeeze(1), token[live]] = True
            if stop_ids.numel():
                done = done | torch.isin(token, stop_ids)
            if stop_strings:
                for b in live.nonzero().squeeze(1).tolist():
                    produced[b].append(int(token[b]))
                    text = decode(produced[b])  # type: ignore[misc]
                    if any(s in text for s in stop_strings):
                        done[b] = True
            if bool(done.all()) or i + 1 == max_new_tokens:  # the last token's successor is never needed
                return
            log_probs = decoder.feed(token.clamp(min=0)[:, None])  # (B, 1) in, one position of work

    return tokens()


def generate(model: TransformerXL, prompt_ids: PromptIds, *,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, generator: torch.Generator | None = None, mem_len: int | None = None,
             segment_len: int = 256, on_token: Callable[[torch.Tensor], None] | None = None,
             stop_tokens: Sequence[int] = (), stop_strings: Sequence[str] = (),
             decode: Callable[[list[int]], str] | None = None, repetition_penalty: float = 1.0,
             compile: bool = False) -> torch.Tensor:
    """The (B, N) new token ids (the prompt not included; ``FINISHED`` after a row stopped, and N smaller
    than ``max_new_tokens`` when every row stopped); ``on_token`` sees each (B,) step as drawn.

    Same arguments as :func:`generate_stream`, which this collects.
    """
    out = []
    for token in generate_stream(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, generator=generator, mem_len=mem_len,
                                 segment_len=segment_len, stop_tokens=stop_tokens, stop_strings=stop_strings,
                                 decode=decode, repetition_penalty=repetition_penalty, compile=compile):
        out.append(token)
        if on_token is not None:
            on_token(token)
    if not out:
        batch = _as_prompt(prompt_ids, model)[0].size(0)
        return torch.zeros(batch, 0, dtype=torch.long, device=next(model.parameters()).device)
    return torch.stack(out, dim=1)  # (B, N)
