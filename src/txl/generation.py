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

The work is ``txl.decoding``'s, the core `txl serve` generates with too: ``Decoder.run`` reads a segment or a
step into left-padded rows whose memory and keys grow in place, ``Picker`` chooses the tokens, ``StopText`` finds
the stop strings.

Prompts of different lengths are read as one batch, left-padded: the pad positions are masked as keys
(``padding=`` of the model's forward) for as long as they stay in the memory, and relative attention does
not see the shift, so each row is generated exactly as it would be alone (with the default ``mem_len``,
which drops nothing): greedily, and when sampling with ``seed``, which gives row b its own generator seeded
``seed + b`` (row b equals its prompt alone with ``seed=seed + b``). A compressive model (cmem_len > 0) batches
them the same way: with the default ``mem_len`` nothing is compressed while generating, so no pad can be; a
``mem_len`` small enough to compress is refused with prompts of different lengths. Generation of a row ends at one of
``stop_tokens`` (which is returned) or once
its text contains one of ``stop_strings``; its later places hold ``FINISHED`` (-1), and generation ends
when every row has stopped. ``repetition_penalty`` (CTRL) lowers the scores of tokens already read or
produced.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import torch

from txl.decoding import Decoder, Picked, Picker, Rows, StopText, check_sampling, positive_int
from txl.evaluate import inference_context
from txl.model import KVCache, Memory, TransformerXL
from txl.model.attention import attn_types, either, encoding

__all__ = ["FINISHED", "IncrementalDecoder", "check_sampling", "generate", "generate_steps", "generate_stream",
           "inference_context"]

FINISHED = -1
"""The id in a row's places after it stopped (at a stop token or stop string)."""


class IncrementalDecoder:
    """The state of one generation: the memory of everything read so far (``txl.decoding.Decoder``'s rows).

    ``feed(ids)`` reads (B, T) more tokens, ``segment_len`` at a time, and returns the (B, V)
    log-probabilities of the token that follows them. A (B, 1) feed is one generation step: one
    position against the cached memory. Not a module: it holds no parameters, only the memory (and
    its key/value cache) that the model hands back (the model itself never holds either).
    """

    def __init__(self, model: TransformerXL, *, mem_len: int, segment_len: int = 256, compile: bool = False) -> None:
        self.model = model
        self.mem_len = positive_int("mem_len", mem_len)
        self.segment_len = positive_int("segment_len", segment_len)
        self.decoder = Decoder(model, mem_len=mem_len, compile=compile)
        self.rows: Rows | None = None
        self.length = 0
        """Tokens read so far."""

    @property
    def memory(self) -> Memory | None:
        return self.rows.memory if self.rows is not None and self.rows.memory else None

    @property
    def kv_cache(self) -> KVCache | None:
        if self.rows is None or not self.rows.keys:
            return None
        return KVCache(keys=self.rows.keys, values=self.rows.values, positions=self.decoder.table,
                       buffers=self.rows.buffers, weights_version=self.rows.version)

    def feed(self, ids: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """Read (B, T) token ids into the memory; return (B, V) float32 log-probs of the next token.

        ``padding``: (B, T) bool, True at pad positions (left padding): no later position attends to them.
        """
        if ids.dim() != 2 or ids.size(1) == 0:
            raise ValueError(f"feed() takes a non-empty (B, T) tensor of token ids, got shape {tuple(ids.shape)}")
        lead = None
        if padding is not None:
            if padding.shape != ids.shape:
                raise ValueError(f"padding has shape {tuple(padding.shape)}, the ids {tuple(ids.shape)}")
            lead = padding.sum(1).tolist()  # (B,) pads per row
            left = torch.arange(ids.size(1), device=padding.device)[None, :] < padding.sum(1, keepdim=True)
            if not torch.equal(left, padding.bool()):
                raise ValueError("padding must be left padding: each row's pads before its tokens")
        with inference_context(self.model):
            for start in range(0, ids.size(1), self.segment_len):
                segment = ids[:, start:start + self.segment_len]  # (B, S)
                seg_lead = None if lead is None else [min(max(n - start, 0), segment.size(1)) for n in lead]
                log_probs, self.rows = self.decoder.run(segment, self.rows, seg_lead)
        self.length += ids.size(1)
        return log_probs


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


def context_bytes(config, batch_size: int, positions: int, element_size: int = 4) -> int:
    """Bytes the generation state takes at ``positions`` positions: every layer's memory rows (B, M, d) and,
    for cacheable attention, their projected keys and values (B, M, H, D) twice."""
    cached = encoding(config.attn_type).cacheable  # the key/value cache holds keys and values as well
    per_layer = config.d_model + (2 * config.n_head * config.d_head if cached else 0)
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


def generate_steps(model: TransformerXL, prompt_ids: PromptIds, *,
                   max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   seed: int | None = None, generator: torch.Generator | None = None,
                   mem_len: int | None = None, segment_len: int = 256, stop_tokens: Sequence[int] = (),
                   stop_strings: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
                   repetition_penalty: float = 1.0, top_logprobs: int = 0, compile: bool = False) -> Iterator[Picked]:
    """Yield each step as drawn: ``txl.decoding.Picked`` with the (B,) tokens (``FINISHED`` in rows that had
    stopped), their (B,) log-probabilities and, with ``top_logprobs`` k, each row's k most likely (id, log-prob).

    The prompt (B, T), or a list of ids, or lists of ids of different lengths (left-padded, see the
    module docstring), is read ``segment_len`` tokens at a time; then each new token is one (B, 1) step
    against the memory. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token.
    Randomness comes only from ``seed`` (row b: a generator seeded ``seed + b``, so each row equals its prompt
    alone with ``seed=seed + b``), or from ``generator``, shared by the rows (neither: torch's global generator).
    ``mem_len`` None keeps the whole context (see the module docstring).
    ``compile`` runs each (B, 1) step as one torch.compile graph (``txl.decoding.Decoder``'s ``compile``; relative
    attention without a compressed memory, else the whole forward through torch.compile).

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
    prompt, padding = _as_prompt(prompt_ids, model)  # (B, T), (B, T) or None
    if padding is not None and not model.encoding.relative:
        raise ValueError("prompts of different lengths need relative positions (attn_type "
                         f"{either(attn_types(relative=True))}): with attn_type={model.config.attn_type!r} left "
                         "padding would shift every position; "
                         "generate for each length separately")
    if mem_len is not None:
        positive_int("mem_len", mem_len)
        c = model.config
        # The last step reads T + N - 1 rows; rows leave a compressive memory from mem_len + cmem_rate on (whole
        # groups): the model refuses pads then (they would be compressed with real rows), so refuse it here, first.
        if padding is not None and c.cmem_len and prompt.size(1) + max_new_tokens - 1 >= mem_len + c.cmem_rate:
            raise ValueError(f"prompts of different lengths with a compressed memory (cmem_len {c.cmem_len}) need "
                             f"a mem_len that compresses nothing (mem_len {mem_len} < {prompt.size(1)} + "
                             f"{max_new_tokens} - {c.cmem_rate}): pads would be compressed with real rows; leave "
                             "mem_len none (every row kept) or generate for each length separately")
    positive_int("segment_len", segment_len)
    positive_int("top_logprobs", top_logprobs, minimum=0)
    B = prompt.size(0)
    # Row b draws from its own generator, seeded seed + b: it is the row generate(its prompt alone, seed=seed + b)
    # gives, whatever else the batch holds (a shared generator would tie each row's draws to the rows before it),
    # and a prompt repeated in a batch still gets different samples.
    pick = Picker(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                  seeds=None if seed is None else [int(seed) + b for b in range(B)], generator=generator,
                  stop_tokens=stop_tokens, top_logprobs=top_logprobs, vocab_size=model.config.vocab_size,
                  device=prompt.device)
    stops = [StopText(stop_strings) for _ in range(B)] if stop_strings else None
    if mem_len is None:
        _check_whole_context(model, B, prompt.size(1), max_new_tokens)
    decoder = IncrementalDecoder(model, mem_len=mem_len or prompt.size(1) + max_new_tokens, segment_len=segment_len,
                                 compile=compile)
    pick.see(prompt, None if padding is None else ~padding)  # pads are not read

    def steps() -> Iterator[Picked]:
        if max_new_tokens == 0:
            return
        log_probs = decoder.feed(prompt, padding)  # (B, V)
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)  # (B,)
        produced: list[list[int]] = [[] for _ in range(B)]
        for i in range(max_new_tokens):
            live = ~done
            step = pick(log_probs, live)
            step.tokens = step.tokens.masked_fill(done, FINISHED)  # (B,)
            yield step
            done = done | step.stopped
            if stops is not None:
                for b in live.nonzero().squeeze(1).tolist():
                    produced[b].append(int(step.tokens[b]))
                    if stops[b].update(decode(produced[b])):  # type: ignore[misc]
                        done[b] = True
            if bool(done.all()) or i + 1 == max_new_tokens:  # the last token's successor is never needed
                return
            log_probs = decoder.feed(step.tokens.clamp(min=0)[:, None])  # (B, 1) in, one position of work

    return steps()


def generate_stream(model: TransformerXL, prompt_ids: PromptIds, **kwargs) -> Iterator[torch.Tensor]:
    """Yield each new token, (B,) int64, as soon as it is drawn (``FINISHED`` in rows that had stopped); the
    arguments of :func:`generate_steps`, which this reads."""
    steps = generate_steps(model, prompt_ids, **kwargs)  # checked now, not at the first next()
    return (step.tokens for step in steps)


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
