"""Segment-level recurrence: the memory of cached hidden states (Dai et al. 2019, section 3.2).

Shapes: B batch, M memory length, T segment length, d d_model, L layers.

A memory is a tuple with one (B, M, d) tensor per layer: the *input* hidden states of that layer for the M positions
before the current segment. It goes in and comes out of the model explicitly; these pure functions are the only
place where it is built, truncated and detached.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Memory = tuple[torch.Tensor, ...]
"""One (B, M, d_model) tensor per layer, oldest position first."""


def zeros_memory(n_layer: int, batch_size: int, d_model: int, length: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Memory:
    """A zero-filled memory of ``length`` positions that *is* attended to, as Hugging Face's TransfoXL and the
    original TensorFlow code start every stream (their checkpoints expect it)."""
    return tuple(torch.zeros(batch_size, length, d_model, device=device, dtype=dtype) for _ in range(n_layer))


def memory_length(memory: Memory | None) -> int:
    return 0 if not memory else memory[0].size(1)


def update_memory(memory: Memory | None, hiddens: list[torch.Tensor], *, mem_len: int, ext_len: int = 0,
                  dtype: torch.dtype | None = None) -> Memory:
    """The memory for the next segment: the last ``mem_len`` layer inputs, gradient stopped, a copy in ``dtype``
    (None: the inputs' own); the old memory stays valid. ``hiddens[l]``: the (B, T, d) input of layer l; its last
    ``ext_len`` positions are fed again with the next segment (extended context), so they are not kept."""
    if mem_len == 0:
        return tuple(h.new_empty((h.size(0), 0, *h.shape[2:])) for h in hiddens)  # any trailing shape: KVCache too
    new = []
    with torch.no_grad():
        for l, h in enumerate(hiddens):
            h = h[:, : h.size(1) - ext_len] if ext_len else h  # (B, T, ...)
            # The segment alone fills the memory: no cat (not under torch.compile: torch.export's T is dynamic).
            fills = not torch.compiler.is_compiling() and h.size(1) >= mem_len
            rows = h if fills or not memory or memory[l].size(1) == 0 else torch.cat([memory[l].to(h.dtype), h], 1)
            new.append(rows[:, -mem_len:].to(dtype or h.dtype, copy=True))  # (B, M', ...)
    return tuple(new)


class RowBuffer:
    """Storage that rows are appended to in place, so a sequence grown a row per (B, 1) step (a generation's memory
    and cached keys/values) is not copied whole at every step, as ``torch.cat`` would. ``data`` (B, C, ...) holds
    rows [0, ``end``); views handed out end at ``end``. Appending writes past ``end``, so every view keeps its
    values; only the view ending at ``end`` is extended in place, an older one is copied into a new buffer."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        """(B, C, ...) storage; rows past ``end`` are unwritten."""
        self.end = 0

    def ends(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a window of this buffer ending at ``end``: [t; new] may then be written in place."""
        d, n = self.data, t.size(1)
        return (0 < n <= self.end and t.dtype == d.dtype and t.device == d.device and t.shape[0] == d.shape[0]
                and t.shape[2:] == d.shape[2:] and t.stride() == d.stride()  # row end - n's address, without a view:
                and t.data_ptr() == d.data_ptr() + (self.end - n) * d.stride(1) * d.element_size())


def append_rows(old: torch.Tensor | None, new: torch.Tensor, buffer: RowBuffer | None, *,
                headroom: int = 64) -> tuple[torch.Tensor, RowBuffer]:
    """[old; new] along dim 1 (B, n + T, ...), a view of ``buffer`` (extended in place when ``old`` is its last
    window and there is room) or of a new buffer with room for ``headroom`` more rows; and the buffer. A small fixed
    headroom, not doubling: a (B, 1) step copies once every ``headroom`` steps without doubling the peak memory."""
    n, T = (0 if old is None else old.size(1)), new.size(1)
    fits = (buffer is not None and old is not None and buffer.ends(old) and new.dtype == buffer.data.dtype
            and buffer.end + T <= buffer.data.size(1)
            and (torch.is_inference_mode_enabled() or not buffer.data.is_inference()))  # writable here
    if not fits:
        buffer = RowBuffer(new.new_empty(new.size(0), n + T + headroom, *new.shape[2:]))  # (B, C, ...)
        if n:
            buffer.data[:, :n] = old
        buffer.end = n
    buffer.data[:, buffer.end:buffer.end + T] = new
    buffer.end += T
    return buffer.data[:, buffer.end - n - T:buffer.end], buffer  # (B, n + T, ...)


def last_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` rows along dim 1 (a view: a RowBuffer's window stays its last one)."""
    return t[:, t.size(1) - n:] if t.size(1) > n else t


def grow_memory(memory: Memory | None, hiddens: list[torch.Tensor], *, mem_len: int,
                buffers: Sequence[RowBuffer | None]) -> tuple[Memory, tuple[RowBuffer, ...]]:
    """``update_memory`` (ext_len 0) with each layer's rows appended in place to its ``RowBuffer``: the memory
    is views of the buffers, returned with them. Under ``torch.no_grad()`` (the KVCache's condition)."""
    new, bufs = [], []
    for l, h in enumerate(hiddens):
        old = memory[l] if memory and memory[l].size(1) else None
        rows, buffer = append_rows(old, h, buffers[l] if buffers else None)  # (B, M + T, d)
        new.append(last_rows(rows, mem_len))
        bufs.append(buffer)
    return tuple(new), tuple(bufs)


def check_memory(memory: Memory, *, n_layer: int, batch_size: int, d_model: int,
                 device: torch.device | None = None) -> None:
    """Raise a ValueError naming what is wrong with a memory passed in by a caller (``device``: the model's)."""
    if not isinstance(memory, (tuple, list)):
        raise ValueError(f"memory must be a tuple of {n_layer} tensors of shape (B, M, {d_model}); "
                         f"got {type(memory).__name__}. Pass the .memory of the previous output, or None")
    if len(memory) != n_layer:
        raise ValueError(f"memory has {len(memory)} layers but the model has n_layer={n_layer}; "
                         "pass the .memory returned by this model, or None to start afresh")
    m0 = memory[0].size(1) if memory[0].dim() == 3 else -1
    for l, m in enumerate(memory):
        if m.dim() != 3 or m.size(0) != batch_size or m.size(1) != m0 or m.size(2) != d_model:
            raise ValueError(
                f"memory[{l}] has shape {tuple(m.shape)}; expected (B={batch_size}, M, d_model={d_model}) "
                "with the same M in every layer (memory is batch-first; a Hugging Face memory is "
                "(M, B, d): transpose it with .transpose(0, 1))")
        if device is not None and m.device != device:
            raise ValueError(f"memory[{l}] is on {m.device} but the model is on {device}: move the memory with "
                             "tuple(m.to(device) for m in memory), or pass the .memory this model returned")
