"""The Transformer-XL language model (Dai et al. 2019).

Shape legend: B batch, T segment length, M memory length, K = M + T, d d_model, V vocabulary,
L layers, P learned positions.

A forward pass reads one segment of token ids with the memory of earlier segments, and returns the
per-token loss (or log-probabilities) and the memory for the next segment:

    embed -> dropout -> [layer_l(h, memory_l) for l in 0..L-1] -> dropout -> adaptive softmax

where memory_l holds the inputs of layer l for the M previous positions (section 3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from txl.config import Context, ModelConfig
from txl.labels import IGNORE_INDEX
from txl.model import kernels
from txl.model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from txl.model.attention import (
    Attention,
    Positions,
    RelativeAttention,
    ShawAttention,
    build_attention,
    relative_distances,
    sinusoid,
)
from txl.model.kv_cache import CACHEABLE_ATTN_TYPES, KVCache, weights_version
from txl.model.memory import Memory, check_memory, memory_length, update_memory, zeros_memory


class FeedForward(nn.Module):
    """Position-wise feed-forward with residual and layer norm (post-LN, or pre-LN)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_ln = config.pre_ln
        self.fc1 = nn.Linear(config.d_model, config.d_inner)
        self.fc2 = nn.Linear(config.d_inner, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = kernels.dropout(config, config.dropout)
        self.relu_drop = kernels.dropout(config, config.dropout, relu=True)  # dropout(relu(.)); fc1's output is fresh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if self.pre_ln else x
        out = self.drop(self.fc2(self.relu_drop(self.fc1(h))))  # (B, T, d)
        return x + out if self.pre_ln else self.norm(x + out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn = build_attention(config)
        self.ff = FeedForward(config)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, mask: torch.Tensor,
                positions: Positions | None, u: torch.Tensor | None, v: torch.Tensor | None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.ff(self.attn(x, memory, mask, positions, u, v, kv=kv))


@dataclass
class LMOutput:
    """What one segment produces. Fields that were not asked for are None."""

    memory: Memory
    """The memory for the next segment: one (B, M', d) tensor per layer, gradient stopped."""
    hidden: torch.Tensor
    """(B, T, d) final hidden states."""
    loss: torch.Tensor | None = None
    """Scalar mean NLL over the labels that are not IGNORE_INDEX (-100)."""
    nll: torch.Tensor | None = None
    """(B, T) per-token NLL; labels[:, t] is the target at position t; 0 where ignored."""
    log_probs: torch.Tensor | None = None
    """(B, T, V) log-probabilities of the next token (float32)."""
    kv_cache: KVCache | None = None
    """With ``kv_cache=`` in: the keys and values of exactly ``memory``'s rows, for the next call."""


def attention_mask(qlen: int, mlen: int, *, mem_len: int, same_length: bool, style: str,
                   device: torch.device | None = None) -> torch.Tensor:
    """(T, K) bool, True where query i may not see key j.

    Causal: query i (key index M+i) sees keys j <= M+i. With same_length every query sees the same
    number of keys, the far ones hidden: mem_len keys in the original PyTorch / Hugging Face convention,
    mem_len + 1 in the original TensorFlow / NVIDIA one (which also keeps the query's own position).
    """
    klen = mlen + qlen
    ones = torch.ones(qlen, klen, dtype=torch.bool, device=device)
    mask = torch.triu(ones, diagonal=1 + mlen)
    if same_length:
        mask_len = klen - mem_len - (1 if style == "tensorflow" else 0)
        shift = qlen - mask_len if mask_len > 0 else qlen
        mask = mask | torch.tril(ones, diagonal=-shift)
    return mask


class TransformerXL(nn.Module):
    """Transformer-XL language model: segment in, loss or log-probabilities and new memory out."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = AdaptiveEmbedding(c)
        self.drop = kernels.dropout(c, c.dropout)
        if c.attn_type == "relative" and not c.untie_r:  # u, v shared by all layers (section 3.3)
            self.u = nn.Parameter(torch.zeros(c.n_head, c.d_head))
            self.v = nn.Parameter(torch.zeros(c.n_head, c.d_head))
        if c.attn_type == "al_rfou":  # a learned absolute position embedding per layer
            self.pos_embed = nn.Parameter(torch.zeros(c.n_layer, c.learned_positions, c.d_model))
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layer))
        self.softmax = AdaptiveLogSoftmax(c)
        self.tie_weights()
        self.reset_parameters()

    # -- construction ---------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """Share output weights and projections with the input ones, as config.tie_* say."""
        c = self.config
        if c.tie_weight:
            for out_layer, emb_layer in zip(self.softmax.layers, self.embed.layers):
                out_layer.weight = emb_layer.weight
        for i, tie in enumerate(c.tie_projs):
            if tie and len(self.softmax.projs):
                self.softmax.projs[i] = self.embed.projs[0 if c.div_val == 1 else i]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The original initialisation, one method dispatching on types.

        Linear and embedding weights, cluster weights, biases u and v and learned positions:
        normal(0, init_std); embedding and softmax projections: normal(0, proj_init_std);
        LayerNorm weights normal(1, init_std); every bias 0.
        """
        c = self.config
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, c.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, c.init_std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (AdaptiveEmbedding, AdaptiveLogSoftmax)):
                for p in module.projs:
                    nn.init.normal_(p, 0.0, c.proj_init_std)
                if isinstance(module, AdaptiveLogSoftmax) and module.n_clusters:
                    nn.init.normal_(module.cluster_weight, 0.0, c.init_std)
                    nn.init.zeros_(module.cluster_bias)
            elif isinstance(module, (RelativeAttention, ShawAttention)):
                for name in ("u", "v", "r_emb", "r_bias"):
                    if isinstance(getattr(module, name, None), nn.Parameter):
                        nn.init.normal_(getattr(module, name), 0.0, c.init_std)
        for name in ("u", "v", "pos_embed"):
            if hasattr(self, name):
                nn.init.normal_(getattr(self, name), 0.0, c.init_std)

    # -- memory ---------------------------------------------------------------------------------
    def init_memory(self, batch_size: int, length: int = 0) -> Memory:
        """An empty memory (length 0), or a zero-filled one that is attended to (Hugging Face style)."""
        p = next(self.parameters())
        return zeros_memory(self.config.n_layer, batch_size, self.config.d_model, length,
                            device=p.device, dtype=p.dtype)

    def start_kv_cache(self) -> KVCache | None:
        """An empty KVCache to pass with the first segment of an evaluation, or None where this model's keys
        cannot be cached ('absolute' and 'al_rfou' add to each memory row a position that shifts every step)."""
        return KVCache() if self.config.attn_type in CACHEABLE_ATTN_TYPES else None

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                memory: Memory | None = None, *, return_log_probs: bool | None = None,
                kv_cache: KVCache | None = None, context: Context | None = None,
                padding: torch.Tensor | None = None) -> LMOutput:
        """Run one segment.

        input_ids: (B, T) int64. labels: (B, T), labels[:, t] the token after input_ids[:, t], or -100
        to ignore. memory: the previous output's memory, or None for an empty one. Log-probabilities
        (B, T, V) are returned when no labels are given, or when return_log_probs is True.

        context: the attention context (mem_len, clamp_len, same_length, ...); None is the config's
        (``config.context()``). Evaluate with a longer one than in training by passing it, as the memory is.

        kv_cache: the previous output's kv_cache (or ``KVCache()`` to start one, filled from ``memory``)
        for incremental decoding: the memory rows' keys and values are read from it instead of being
        projected again, with the same result. Eval mode under ``torch.no_grad()`` only; see
        ``txl.model.kv_cache``.

        padding: (B, M + T) bool, True at pad positions of the memory rows and the segment (left-padded
        prompts of different lengths read as one batch). No other position attends to a pad, so each row
        computes what it would alone; relative attention makes the shift of its positions irrelevant.
        Pads see only earlier pads (each other), so no softmax is empty; their outputs are meaningless.
        """
        c = self.config
        ctx = c.context() if context is None else context
        if not torch.compiler.is_compiling():  # checks at the boundary; value checks sync with the device
            self.check_inputs(input_ids, labels, memory, kv_cache, ctx)
        B, T = input_ids.shape
        M = memory_length(memory)
        # Dai et al. 2019, eq. (1): SG(memory), no gradient flows into earlier segments.
        mems = [m.detach() for m in memory] if M else [None] * c.n_layer
        mask = attention_mask(T, M, mem_len=ctx.mem_len, same_length=ctx.same_length,
                              style=ctx.same_length_style, device=input_ids.device)  # (T, K)
        if padding is not None:
            if padding.shape != (B, M + T) or padding.dtype != torch.bool:
                raise ValueError(f"padding must be a (B, M + T) = ({B}, {M + T}) bool tensor over the memory rows "
                                 f"and the segment, got {padding.dtype} {tuple(padding.shape)}")
            # A real query never sees a pad key; a pad query keeps its causal keys (pads, being on the left).
            hide = padding[:, None, :] & ~padding[:, M:, None]  # (B, T, K)
            mask = (mask | hide)[:, None]  # (B, 1, T, K)

        h = self.drop(self.embed(input_ids))  # (B, T, d)
        table = ()
        if c.attn_type == "relative" and kv_cache is not None:
            table = self._position_table(kv_cache.positions, M + T, ctx.clamp_len, h.dtype)
        positions = self._relative_positions(M + T, ctx.clamp_len, h.dtype, input_ids.device, table)
        absolute = self._absolute_positions(M + T, ctx.clamp_len, h.dtype, input_ids.device)

        u, v = (getattr(self, "u", None), getattr(self, "v", None))
        hiddens, keys, values = [], [], []
        for l, layer in enumerate(self.layers):
            hiddens.append(h)  # memory caches each layer's input, before any absolute positions
            x, mem = h, mems[l]
            if absolute[l] is not None:  # (K, d): memory rows get the earlier positions
                x = x + absolute[l][M:]
                mem = None if mem is None else mem + absolute[l][:M]
            kv = None
            if kv_cache is not None:
                kv, mem = kernels.cached_keys_values(layer.attn, x, mem, kv_cache, l), None  # (B, K, H, D) each
                keys.append(kv[0])
                values.append(kv[1])
            h = layer(x, mem, mask, positions[l], u, v, kv=kv)
        h = self.drop(h)  # (B, T, d)
        new_memory = update_memory(memory if M else None, hiddens, mem_len=ctx.mem_len, ext_len=ctx.ext_len)

        out = LMOutput(memory=new_memory, hidden=h)
        if kv_cache is not None:
            # keys/values cover all K rows, so truncating them as a whole keeps them aligned with new_memory.
            out.kv_cache = KVCache(keys=update_memory(None, keys, mem_len=ctx.mem_len, ext_len=ctx.ext_len),
                                   values=update_memory(None, values, mem_len=ctx.mem_len, ext_len=ctx.ext_len),
                                   positions=table, weights_version=weights_version(self))
        flat = h.reshape(B * T, -1)  # (B*T, d)
        if labels is not None:
            out.nll = self.softmax.nll(flat, labels.reshape(-1)).view(B, T)  # (B, T)
            n = (labels != IGNORE_INDEX).sum()
            out.loss = out.nll.sum() / n.clamp(min=1)
        if return_log_probs or (return_log_probs is None and labels is None):
            out.log_probs = self.softmax.log_prob(flat).view(B, T, -1)  # (B, T, V)
        return out

    def _relative_positions(self, klen: int, clamp_len: int, dtype: torch.dtype, device: torch.device,
                            table: tuple[torch.Tensor, ...]) -> list[Positions | None]:
        """Per layer, the relative encodings of key index 0..K-1: R (dropout applied, shared by the layers),
        or each layer's projected W_kR R read from a KVCache table; None for the other attention types."""
        if self.config.attn_type != "relative":
            return [None] * self.config.n_layer
        dist = relative_distances(klen, clamp_len, device)  # (K,): K-1 .. 0, clamped
        if table:  # W_kR R depends on the distance alone: index the cache's table
            return [Positions(projected=t[dist]) for t in table]  # (K, H, D) each
        r = Positions(encodings=self.drop(sinusoid(dist, self.config.d_model).to(dtype)))  # (K, d)
        return [r] * self.config.n_layer

    def _absolute_positions(self, klen: int, clamp_len: int, dtype: torch.dtype,
                            device: torch.device) -> list[torch.Tensor | None]:
        """Per layer, the (K, d) absolute encodings added to its input, or None.

        'absolute' (Vaswani et al.): one sinusoid at the first layer's input, positions K-1 .. 0.
        'al_rfou': a learned embedding at every layer's input (row P-1 the newest position).
        """
        c = self.config
        if c.attn_type == "absolute":
            r = sinusoid(relative_distances(klen, clamp_len, device), c.d_model).to(dtype)  # (K, d)
            return [self.drop(r)] + [None] * (c.n_layer - 1)
        if c.attn_type != "al_rfou":
            return [None] * c.n_layer
        out = []
        for emb in self.pos_embed:  # (P, d) per layer
            P = emb.size(0)
            if klen > P:  # older than learned: repeat the oldest
                emb = torch.cat([emb[:1].expand(klen - P, -1), emb])  # (K, d)
            out.append(self.drop(emb[-klen:]))  # (K, d)
        return out

    def _position_table(self, table: tuple[torch.Tensor, ...], klen: int, clamp_len: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The cache's per-layer W_kR R table, grown to the farthest distance of K keys."""
        farthest = min(klen - 1, clamp_len) if clamp_len > 0 else klen - 1  # dist[0], without a sync
        p = next(self.parameters())
        return kernels.position_table([layer.attn for layer in self.layers], table, farthest + 1,
                                      clamp_len=clamp_len, d_model=self.config.d_model, dtype=dtype,
                                      device=p.device)

    def check_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                     memory: Memory | None = None, kv_cache: KVCache | None = None,
                     context: Context | None = None) -> None:
        """Raise a ValueError naming what is wrong with the arguments of ``forward``.

        ``forward`` calls it, except under torch.compile: the range checks read token values back from the
        device (a host sync and a graph break), so compiled callers check at their boundary, once.
        """
        c = self.config
        ctx = c.context() if context is None else context
        if not isinstance(ctx, Context):
            raise ValueError(f"context must be a txl.Context (model.config.context(mem_len=...)), "
                             f"got {type(ctx).__name__}")
        self._check_inputs(input_ids, labels, ctx)
        B = input_ids.size(0)
        if memory is not None:
            check_memory(memory, n_layer=c.n_layer, batch_size=B, d_model=c.d_model)
        if kv_cache is not None:
            self._check_kv_cache(kv_cache, memory_length(memory), B)

    def _check_kv_cache(self, cache: KVCache, mlen: int, batch_size: int) -> None:
        """Raise a ValueError saying why ``cache`` cannot stand for the memory rows' keys and values."""
        c = self.config
        if not isinstance(cache, KVCache):
            raise ValueError(f"kv_cache must be a KVCache (KVCache() to start one), got {type(cache).__name__}")
        if c.attn_type not in CACHEABLE_ATTN_TYPES:
            raise ValueError(f"kv_cache is not supported with attn_type={c.attn_type!r}: it adds a position "
                             "that shifts every step to each memory row, so the keys change; pass kv_cache=None")
        if self.training or torch.is_grad_enabled():
            raise ValueError("kv_cache needs eval mode under torch.no_grad(): cached keys are detached (weight "
                             "gradients through memory rows would be lost) and dropout would change them; "
                             "call model.eval() and wrap the call in torch.no_grad(), or pass kv_cache=None")
        if not cache.keys:
            return  # an empty cache is filled from the memory
        if len(cache.keys) != c.n_layer or len(cache.values) != c.n_layer:
            raise ValueError(f"kv_cache has {len(cache.keys)} layers but the model has n_layer={c.n_layer}; "
                             "pass the .kv_cache returned by this model, or KVCache()")
        k = cache.keys[0]
        if cache.length != mlen or k.size(0) != batch_size:
            raise ValueError(f"kv_cache holds {cache.length} rows for batch {k.size(0)} but the memory has "
                             f"{mlen} rows for batch {batch_size}: pass the kv_cache returned with this memory "
                             "(both come from the same output), or KVCache() to rebuild it from the memory")
        if cache.weights_version != weights_version(self):
            raise ValueError("kv_cache was built with other weights (a parameter changed since): its keys are "
                             "stale; pass KVCache() to rebuild it from the memory")

    def _check_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor | None, ctx: Context) -> None:
        c = self.config
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be a (B, T) integer tensor; got {input_ids.dtype} of shape "
                             f"{tuple(input_ids.shape)} (add a batch dimension with .unsqueeze(0))")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty: pass at least one token")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= c.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is out of range for vocab_size={c.vocab_size}; "
                             "encode with the vocabulary this model was trained with")
        if ctx.ext_len and ctx.ext_len >= input_ids.size(1):
            raise ValueError(f"ext_len={ctx.ext_len} must be shorter than the segment ({input_ids.size(1)} "
                             "tokens); lower ext_len or feed longer segments")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}; labels[:, t] is the token after input_ids[:, t]")
            valid = labels[labels != IGNORE_INDEX]
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= c.vocab_size):
                raise ValueError(f"a label is out of range for vocab_size={c.vocab_size} "
                                 f"(use {IGNORE_INDEX} to ignore a position)")


__all__ = ["Attention", "DecoderLayer", "FeedForward", "KVCache", "LMOutput", "TransformerXL", "attention_mask"]
