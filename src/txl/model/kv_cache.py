"""A key/value cache for incremental decoding: the memory rows' projected keys and values.

Shape legend: B batch, M memory length, T segment length, K = M + T, H heads, D head width,
N rows of the positional table, L layers.

Without a cache every forward re-projects the keys and values of all M memory rows (W_kE h, W_v h,
2 M d^2 per layer) and the K relative encodings (W_kR R, K d^2 per layer), although neither changes
from one step to the next once the weights are fixed. A KVCache keeps both, so a (B, 1) step costs
one position of projections plus attention over the cached rows.

Like the memory, the cache goes into ``TransformerXL.forward(..., kv_cache=)`` and comes back as
``LMOutput.kv_cache``; modules never hold it. It is valid only:

* in eval mode without autograd (``torch.no_grad()``): the keys are detached, so gradients to W_kE and
  W_v through memory rows would silently be lost, and dropout would make cached rows differ;
* with the weights it was built with (checked through the parameters' version counters);
* next to the memory it was returned with: same length and alignment, truncated in the same place
  (``update_memory``);
* for 'relative', 'shaw' and 'rotary' attention ('rotary' caches unrotated keys and rotates them by
  their place in each window). 'absolute' and 'al_rfou' add to every memory row a position that shifts
  each step, so its keys change and cannot be cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CACHEABLE_ATTN_TYPES = ("relative", "shaw", "rotary")
"""Attention types whose memory-row keys do not change from step to step (see the module docstring)."""


@dataclass(frozen=True)
class KVCache:
    """Per layer: the keys and values of exactly the memory rows, and W_kR R(n) for distances 0..N-1.

    ``KVCache()`` is an empty cache to start with: it is filled from the memory passed with it.
    """

    keys: tuple[torch.Tensor, ...] = ()
    """One (B, M, H, D) tensor per layer: W_kE h (W_kE LN(h) with pre-LN) of the memory rows."""
    values: tuple[torch.Tensor, ...] = ()
    """One (B, M, H, D) tensor per layer: W_v h of the memory rows."""
    positions: tuple[torch.Tensor, ...] = ()
    """Relative attention: one (N, H, D) tensor per layer, row n = W_kR R(n); grown when K needs more."""
    weights_version: int | None = None
    """Sum of the parameters' version counters when the cache was built: an optimiser step changes it."""

    @property
    def length(self) -> int:
        """M, the memory rows cached (0 for an empty cache)."""
        return self.keys[0].size(1) if self.keys else 0


def weights_version(module: torch.nn.Module) -> int:
    """Changes whenever a parameter is modified in place (optimiser steps, load_state_dict, copy_).

    Parameters created under ``torch.inference_mode()`` have no version counter; they count as 0.
    """
    return sum(0 if p.is_inference() else p._version for p in module.parameters())


__all__ = ["CACHEABLE_ATTN_TYPES", "KVCache", "weights_version"]
