"""The Compressive Transformer's second memory (Rae, Potapenko, Jayakumar, Lillicrap, ICLR 2020).

Shape legend: B batch, T segment length, M memory length, C compressed slots, c compression rate
(``cmem_rate``), N rows leaving the memory (a multiple of c), d d_model, H heads, D head width, L layers.

Transformer-XL drops the states that leave its memory of ``mem_len`` rows. The Compressive Transformer
compresses them instead, c rows to one slot, into a second memory of ``cmem_len`` slots per layer (oldest
slots dropped), and every layer attends over [compressed; memory; segment] (Rae et al. 2020, Algorithm 1).

**The state.** A compressive model's memory (``forward(memory=)`` in, ``LMOutput.memory`` out) holds both:
2L tensors, the L plain ones (B, M, d) first, then the L compressed ones (B, C, d), oldest row first in each
(``split_state``). Left padding is taken while nothing is or gets compressed. A KV cache holds the keys and values
of the window [compressed; memory]: kept while the window only grows, rebuilt after a compression.

**Eviction.** Rows leave the memory in whole groups of c: of the M + T rows of [memory; segment] the oldest
floor((M + T - mem_len) / c) x c are compressed and the memory keeps the rest (mem_len to mem_len + c - 1 rows).

**Positions.** Each row takes the position of its index in the window, as Algorithm 1 feeds the concatenation to
Transformer-XL's attention: compressed slot j of C is at distance C + M + i - j from query i (a function of i - j,
which ``rel_shift``, the kernels and the KV cache's distance table rely on).

**Training.** The compressed memory is built under a stop-gradient like the memory (Dai et al. 2019, eq. (1)); its
parameters ('conv') are trained by the attention-reconstruction loss alone (Rae et al. 2020, Algorithm 2): per layer
|| attn(h, old) - attn(h, f_c(old)) ||^2, with h, the old rows and the layer's weights stop-gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig
from txl.model.kv_cache import KVCache
from txl.model.memory import Memory, memory_length


def split_state(state: Memory | None, n_layer: int) -> tuple[Memory | None, Memory | None]:
    """A compressive model's memory -> (memory, compressed): L tensors (B, M, d) and L tensors (B, C, d)."""
    if state is None:
        return None, None
    if not isinstance(state, (tuple, list)) or len(state) != 2 * n_layer:
        n = len(state) if isinstance(state, (tuple, list)) else type(state).__name__
        raise ValueError(f"a compressive model's memory holds 2 x n_layer = {2 * n_layer} tensors (the memory, then "
                         f"the compressed memory, one per layer); got {n}. Pass the .memory of the previous "
                         "output, or None to start afresh")
    return tuple(state[:n_layer]), tuple(state[n_layer:])


def window(memory: Memory | None, compressed: Memory | None) -> Memory | None:
    """Per layer the rows the layer attends to before the segment: [compressed; memory] (B, C + M, d)."""
    if memory is None or not compressed or compressed[0].size(1) == 0:  # no compressed rows: the memory as is
        return memory
    return tuple(torch.cat([cm, m.to(cm.dtype)], dim=1) for cm, m in zip(compressed, memory))  # (B, C + M, d)


def evict(memory: Memory | None, hiddens: Sequence[torch.Tensor], *, mem_len: int, rate: int
          ) -> tuple[Memory, list[torch.Tensor]]:
    """The memory for the next segment and, per layer, the rows leaving it (B, N, d), N a multiple of ``rate``
    (the module docstring's eviction), gradient stopped."""
    kept, leaving = [], []
    with torch.no_grad():
        for l, h in enumerate(hiddens):
            rows = h if not memory or memory[l].size(1) == 0 else torch.cat([memory[l].to(h.dtype), h], dim=1)
            n = max(0, rows.size(1) - mem_len) // rate * rate  # (B, M + T, d): the first n rows leave
            kept.append(rows[:, n:].detach().contiguous() if n else rows.detach())  # (B, M', d)
            leaving.append(rows[:, :n].detach())  # (B, N, d)
    return tuple(kept), leaving


def content_attention(queries: torch.Tensor, rows: torch.Tensor, *, w_qkv: torch.Tensor, n_head: int,
                      norm: tuple[torch.Tensor, torch.Tensor, float] | None) -> torch.Tensor:
    """A layer's content attention (no positional term) of queries (B, T, d) over rows (B, N, d): (B, H, T, D).
    ``w_qkv`` (3 H D, d): the layer's fused W_q, W_kE, W_v; ``norm``: its pre-LN norm (weight, bias, eps) or None."""
    if norm is not None:
        queries = F.layer_norm(queries, queries.shape[-1:], norm[0], norm[1], norm[2])
        rows = F.layer_norm(rows, rows.shape[-1:], norm[0], norm[1], norm[2])
    B, T, _ = queries.shape
    N = rows.size(1)
    D = w_qkv.size(0) // (3 * n_head)
    q = F.linear(queries, w_qkv[:n_head * D]).view(B, T, n_head, D).transpose(1, 2)  # (B, H, T, D)
    k, v = F.linear(rows, w_qkv[n_head * D:]).view(B, N, 2, n_head, D).unbind(2)  # (B, N, H, D) each
    return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))  # (B, H, T, D)


class Compressor(nn.Module):
    """The compression function f_c: (B, N, d) rows -> (B, N / c, d) slots, and the compressed memory's update.
    'conv': a 1-D convolution of kernel and stride c (Rae et al. 2020's best), initialised to mean pooling;
    'mean' and 'max': pooling over each group of c rows, no parameters."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fn, self.rate, self.cmem_len = config.cmem_fn, config.cmem_rate, config.cmem_len
        d, c = config.d_model, config.cmem_rate
        self.learns = config.cmem_fn == "conv"  # f_c has parameters, trained by the reconstruction loss
        if self.learns:  # torch.empty, no random draw: the rest of the model initialises as without a compressor
            self.weight = nn.Parameter(torch.empty(d, d, c))  # (d_out, d_in, c): Conv1d's layout
            self.bias = nn.Parameter(torch.empty(d))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """'conv': mean pooling, weight[o, i, k] = [o == i] / c, bias 0."""
        if self.learns:
            d = self.weight.size(0)
            eye = torch.eye(d, dtype=self.weight.dtype, device=self.weight.device)  # (d, d)
            self.weight.copy_(eye[:, :, None].expand(d, d, self.rate) / self.rate)  # (d, d, c)
            self.bias.zero_()

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, N, d) rows, N a multiple of c -> (B, N / c, d) compressed slots."""
        B, N, d = rows.shape
        if self.learns:  # (B, d, N) -> (B, d, N / c) -> (B, N / c, d)
            return F.conv1d(rows.to(self.weight.dtype).transpose(1, 2), self.weight, self.bias,
                            stride=self.rate).transpose(1, 2)
        groups = rows.view(B, N // self.rate, self.rate, d)  # (B, N / c, c, d)
        return groups.mean(2) if self.fn == "mean" else groups.amax(2)  # (B, N / c, d)

    def update(self, memory: Memory | None, compressed: Memory | None, hiddens: Sequence[torch.Tensor], *,
               mem_len: int, layers: Sequence[nn.Module], train: bool) -> tuple[Memory, torch.Tensor | None]:
        """The next state (the L memory tensors, then the L compressed ones) and, with ``train``, the
        attention-reconstruction loss (mean over layers; None without parameters). ``hiddens[l]``: layer l's input
        rows (B, T, d), also the reconstruction's queries; ``layers``: each layer's attention (its weights read,
        gradient stopped)."""
        kept, leaving = evict(memory, hiddens, mem_len=mem_len, rate=self.rate)
        learn = train and self.learns and torch.is_grad_enabled()
        new, losses = [], []
        for l, old in enumerate(leaving):
            have = compressed[l] if compressed else old.new_empty(old.size(0), 0, old.size(2))  # (B, C, d)
            if old.size(1) == 0:
                new.append(have)
                continue
            with torch.set_grad_enabled(learn):
                slots = self(old)  # (B, N / c, d)
            if learn:
                losses.append(self.reconstruction_error(hiddens[l].detach(), old, slots, layers[l]))
            slots = slots.detach().to(have.dtype)
            cat = torch.cat([have, slots], dim=1) if have.size(1) else slots  # (B, C + N / c, d)
            new.append(cat[:, -self.cmem_len:].contiguous() if cat.size(1) > self.cmem_len else cat)
        if not learn:
            return (*kept, *new), None
        # Every step uses every compression parameter, also one that compressed nothing (the first segments of a
        # stream): DDP's reducer then sees the same parameters used at every step.
        return (*kept, *new), torch.stack(losses).mean() if losses else sum(p.sum() * 0.0 for p in self.parameters())

    @staticmethod
    def next_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], buffers: Sequence | None,
                   memory: Memory | None, state: Memory, T: int, *, positions, weights_version) -> KVCache:
        """The KV cache for the call after one that read T tokens over the window [compressed; ``memory``] with
        ``keys``, ``values`` (B, C + M + T, H, D) per layer (``buffers``: their RowBuffers, or None) and returned
        ``state``: these keys while nothing was compressed (the window only grew), else an empty cache."""
        if memory_length(state[:len(keys)]) != memory_length(memory) + T:  # rows left the memory: a new window
            return KVCache(positions=positions)
        return KVCache(keys=tuple(keys), values=tuple(values), positions=positions, weights_version=weights_version,
                       buffers=tuple((None, *b) for b in buffers) if buffers is not None else ())

    @staticmethod
    def reconstruction_error(queries: torch.Tensor, old: torch.Tensor, slots: torch.Tensor, attn: nn.Module
                             ) -> torch.Tensor:
        """Rae et al. 2020, Algorithm 2: || attn(h, old) - attn(h, f_c(old)) ||^2 (the mean squared error),
        the layer's weights and the rows gradient-stopped: only ``slots``' graph (f_c's parameters) learns."""
        w = _whole(attn.qkv.weight)
        norm = (_whole(attn.norm.weight), _whole(attn.norm.bias), attn.norm.eps) if attn.pre_ln else None
        with torch.no_grad():
            target = content_attention(queries, old, w_qkv=w, n_head=attn.n_head, norm=norm)  # (B, H, T, D)
        got = content_attention(queries, slots.to(queries.dtype), w_qkv=w, n_head=attn.n_head, norm=norm)
        return F.mse_loss(got.float(), target.float())


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A layer's weight, detached, whole: read outside the layer's own forward, a sharded model's (FSDP2) weight is
    the local shard of a DTensor, so it is gathered here (every process reads the same layers in the same order)."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


__all__ = ["Compressor", "content_attention", "evict", "split_state", "window"]
