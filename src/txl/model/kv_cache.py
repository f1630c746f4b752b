"""A key/value cache for incremental decoding: the memory rows' projected keys and values.

Shape legend: B batch, M memory length, T segment length, K = M + T, H heads, D head width,
N rows of the positional table, L layers.

Without a cache every forward projects again the keys and values of all M memory rows (W_kE h, W_v h) and the K
relative encodings (W_kR R), although neither changes while the weights are fixed; a KVCache keeps both. Like the
memory it goes into ``TransformerXL.forward(..., kv_cache=)`` and comes back as ``LMOutput.kv_cache``. It is valid
only in eval mode without autograd (``torch.no_grad()``: cached keys are detached, and dropout would make them
differ), with the weights it was built with (checked by the parameters' version counters), next to the memory it
was returned with (same length and alignment), and for the ``cacheable`` encodings (``txl.model.attention``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from txl.model.memory import RowBuffer, append_rows
from txl.model.positions import sinusoid


@dataclass(frozen=True)
class KVCache:
    """Per layer: the keys and values of exactly the memory rows, and W_kR R(n) for distances 0..N-1. ``KVCache()``
    is an empty cache to start with: it is filled from the memory passed with it."""

    keys: tuple[torch.Tensor, ...] = ()
    """One (B, M, H, D) tensor per layer: W_kE h (W_kE LN(h) with pre-LN) of the memory rows."""
    values: tuple[torch.Tensor, ...] = ()
    """One (B, M, H, D) tensor per layer: W_v h of the memory rows."""
    positions: tuple[torch.Tensor, ...] = ()
    """Relative attention: one (N, H, D) tensor per layer, row n = W_kR R(N-1-n), the farthest distance first (the
    distances K-1 .. 0 a forward pass reads are its last K rows, a view); grown when K needs more."""
    buffers: tuple[tuple[RowBuffer, RowBuffer, RowBuffer], ...] = ()
    """Per layer, the ``RowBuffer``s the memory, keys and values returned with it are views of, which the next call
    appends to in place; () when they are plain tensors (torch.compile, ext_len, a cache put together by hand)."""
    weights_version: int | None = None
    """Sum of the parameters' version counters when the cache was built: an optimiser step changes it
    (None: built under torch.compile, which cannot read them; not checked)."""

    @property
    def length(self) -> int:
        """M, the memory rows cached (0 for an empty cache)."""
        return self.keys[0].size(1) if self.keys else 0


def weights_version(module: torch.nn.Module) -> int:
    """Changes whenever a parameter is modified in place (optimiser steps, load_state_dict, copy_); parameters made
    under ``torch.inference_mode()`` count as 0. The module tree is walked directly (``parameters()`` builds names
    and a set: slower, read at every decoding step); a shared parameter counts twice, which changes nothing."""
    total, todo = 0, [module]
    while todo:
        m = todo.pop()
        todo.extend(c for c in m._modules.values() if c is not None)  # a submodule slot may be None
        for p in m._parameters.values():
            if p is not None and not p.is_inference():
                total += p._version
    return total


def position_table(projections: Sequence[Callable[[torch.Tensor], torch.Tensor]], table: tuple[torch.Tensor, ...],
                   need: int, *, clamp_len: int, d_model: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per layer (N, H, D), row n = W_kR R(N-1-n) (the farthest first: a pass over K keys reads the last K rows), N >=
    need; ``projections``: each layer's W_kR. Grown by doubling (clamp_len caps it): each distance projected once."""
    have = table[0].size(0) if table else 0
    if have >= need:
        return table
    size = max(need, 2 * have) if clamp_len <= 0 else min(max(need, 2 * have), clamp_len + 1)  # clamp_len caps it
    r = sinusoid(torch.arange(size - 1, have - 1, -1, device=device), d_model).to(dtype)  # (size-have, d), far first
    new = [project(r) for project in projections]  # (size-have, H, D) each
    return tuple(new) if not table else tuple(torch.cat([n, old]) for old, n in zip(table, new))


def cached_keys_values(keys_values: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                       memory: torch.Tensor | None, cache: KVCache, layer: int, *, grow: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, tuple[RowBuffer, RowBuffer] | None]:
    """The keys and values (B, K, H, D) of [memory; segment], the memory rows' read from ``cache`` (an empty one: the
    memory rows projected once, here), and with ``grow`` the RowBuffers they are views of. ``keys_values``: the
    layer's projection of (B, N, d) rows to keys and values (B, N, H, D)."""
    rows = x if cache.keys or memory is None else torch.cat([memory.to(x.dtype), x], dim=1)  # (B, T or K, d)
    k, val = keys_values(rows)  # (B, T or K, H, D) each
    old_k, old_val = (cache.keys[layer].to(k.dtype), cache.values[layer].to(val.dtype)) if cache.keys else (None, None)
    if not grow:  # (B, M, H, D) cached rows before the (B, T, H, D) new ones
        return (k, val, None) if old_k is None else (torch.cat([old_k, k], 1), torch.cat([old_val, val], 1), None)
    had = cache.buffers[layer] if cache.buffers else (None, None, None)  # an empty cache: new buffers
    k, k_buffer = append_rows(old_k, k, had[1])  # (B, K, H, D)
    val, val_buffer = append_rows(old_val, val, had[2])  # (B, K, H, D)
    return k, val, (k_buffer, val_buffer)


__all__ = ["KVCache", "cached_keys_values", "position_table", "weights_version"]
