"""The Transformer-XL language model (Dai et al. 2019).

Shape legend: B batch, T segment length, M memory length, K = M + T, d d_model, V vocabulary, L layers.

A forward pass reads one segment of token ids with the memory of earlier segments, and returns the per-token loss
(or log-probabilities) and the memory for the next segment (memory_l: the inputs of layer l for the M previous
positions, section 3.2):

    embed -> dropout -> [layer_l(h, memory_l) for l in 0..L-1] -> dropout -> adaptive softmax
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from txl.config import ComputeConfig, Context, ModelConfig
from txl.labels import IGNORE_INDEX
from txl.model import casting, kernels, plain, plan
from txl.model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from txl.model.attention import Attention, build_attention, encoding
from txl.model.compressive import Compressor, split_state
from txl.model.dropout import Dropout
from txl.model.kv_cache import KVCache, cached_keys_values, weights_version
from txl.model.memory import Memory, check_memory, grow_memory, last_rows, memory_length, zeros_memory
from txl.model.plain import LMOutput
from txl.model.positions import Positions, attention_mask


class FeedForward(nn.Module):
    """Position-wise feed-forward with residual and layer norm (post-LN, or pre-LN)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_ln = config.pre_ln
        self.fc1 = nn.Linear(config.d_model, config.d_inner)
        self.fc2 = nn.Linear(config.d_inner, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = Dropout(config.dropout)
        self.relu_drop = Dropout(config.dropout, relu=True)  # dropout(relu(.))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = kernels.layer_norm(self.norm, x) if self.pre_ln else x  # pre-LN normalises what fc1 reads
        out = self.drop(self.fc2(self.relu_drop(self.fc1(h))))  # (B, T, d)
        return x + out if self.pre_ln else kernels.layer_norm(self.norm, x + out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn = build_attention(config)
        self.ff = FeedForward(config)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, mask: torch.Tensor,
                positions: Positions | None, u: torch.Tensor | None, v: torch.Tensor | None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.ff(self.attn(x, memory, mask, positions, u, v, kv=kv))


class TransformerXL(nn.Module):
    """Transformer-XL language model: segment in, loss or log-probabilities and new memory out.

    ``forward(input_ids, labels=None, memory=None, *, return_log_probs=None, kv_cache=None, context=None,
    padding=None) -> LMOutput``:

    input_ids: (B, T) int64. labels: (B, T), labels[:, t] the token after input_ids[:, t], or -100
    to ignore. memory: the previous output's memory, or None for an empty one. Log-probabilities
    (B, T, V) are returned when no labels are given, or when return_log_probs is True.

    context: the attention context (mem_len, clamp_len, same_length, ...); None is the config's
    (``config.context()``). Evaluate with a longer one than in training by passing it, as the memory is.

    kv_cache: the previous output's kv_cache (or ``KVCache()`` to start one, filled from ``memory``)
    for incremental decoding: the memory rows' keys and values are read from it instead of being
    projected again, with the same result. Eval mode under ``torch.no_grad()`` only (``txl.model.kv_cache``).

    padding: (B, M + T) bool, True at pad positions of the memory rows and the segment (left-padded
    prompts of different lengths read as one batch): each row computes what it would alone (with a relative
    encoding); pads' outputs are meaningless. A compressive model takes it while nothing is or gets compressed.

    ``compute.attn_impl='reference'`` runs the plain path (``txl.model.plain``); how the model computes on its device
    is ``self.plan`` (``txl.model.plan``), resolved from ``compute`` (None: the defaults) where it is built or moved.
    """

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__()
        self.config, self.compute = config, ComputeConfig() if compute is None else compute
        c = config
        self.embed = AdaptiveEmbedding(c)
        self.drop = Dropout(c.dropout)
        self.encoding = encoding(c.attn_type)  # the layers' attention class: its traits and its positions
        # Parameters of the encoding the layers share: the relative attention's u and v (section 3.3,
        # unless untie_r), Al-Rfou's per-layer position embedding. Named as in the original's checkpoints.
        for name, shape in self.encoding.shared_parameters(c).items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layer))
        self.softmax = AdaptiveLogSoftmax(c)
        # Rae et al. 2020: the second, compressed memory's function (every encoding positions rows by window index)
        self.compressor = Compressor(c) if c.cmem_len else None
        self.tie_weights()
        self.reset_parameters()
        self.use_plan(plan.compute_plan(self.compute, next(self.parameters()).device.type))

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
        """The original initialisation, one method dispatching on types: linear and embedding weights, cluster
        weights, biases u and v and learned positions normal(0, init_std); embedding and softmax projections
        normal(0, proj_init_std); LayerNorm weights normal(1, init_std); every bias 0."""
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
            elif isinstance(module, Compressor):  # no draw: mean pooling
                module.reset_parameters()
            elif isinstance(module, Attention):  # an encoding's own parameters: u, v, Shaw's E and b
                for p in module._parameters.values():
                    nn.init.normal_(p, 0.0, c.init_std)
        for name in self.encoding.shared_parameters(c):
            nn.init.normal_(getattr(self, name), 0.0, c.init_std)

    def use_plan(self, compute: plan.ComputePlan) -> None:
        """Hand ``compute`` (``txl.model.plan``) to the modules that read it, so no forward tests the device."""
        self.plan = compute
        for module in self.modules():
            if isinstance(module, (AdaptiveEmbedding, AdaptiveLogSoftmax)):
                module.rows = compute.cluster_rows
            if isinstance(module, AdaptiveLogSoftmax):
                module.pad, module.cast_weights = compute.softmax_pad, compute.cast_weights
            if isinstance(module, Attention):
                module.pin_sdpa, module.recompute = compute.pin_sdpa, compute.recompute_attention
            if isinstance(module, Dropout):
                module.gaps = compute.gap_dropout

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``to``, ``cuda``, ``to_empty``), then the plan made again for the model's device."""
        super()._apply(fn, recurse)
        device = next(self.parameters()).device
        if getattr(self, "plan", None) is not None and self.plan.device_type != device.type:
            self.use_plan(plan.compute_plan(self.compute, device.type))
        return self

    # -- memory ---------------------------------------------------------------------------------
    def init_memory(self, batch_size: int, length: int = 0) -> Memory:
        """An empty memory (length 0), or a zero-filled one that is attended to (Hugging Face style)."""
        p, c = next(self.parameters()), self.config
        memory = zeros_memory(c.n_layer, batch_size, c.d_model, length, device=p.device, dtype=p.dtype)
        if self.compressor is not None:  # and an empty compressed memory
            memory += zeros_memory(c.n_layer, batch_size, c.d_model, 0, device=p.device, dtype=p.dtype)
        return memory

    def start_kv_cache(self) -> KVCache | None:
        """An empty KVCache to pass with the first segment of an evaluation, or None where this model's keys
        cannot be cached ('absolute' and 'al_rfou' add to each memory row a position that shifts every step)."""
        return KVCache() if self.encoding.cacheable else None

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                memory: Memory | None = None, *, return_log_probs: bool | None = None,
                kv_cache: KVCache | None = None, context: Context | None = None,
                padding: torch.Tensor | None = None) -> LMOutput:
        """One segment, memory in and out: the arguments as the class docstring says."""
        c = self.config
        ctx = c.context() if context is None else context
        # The weights' version, read once for the cache's check and the cache returned (it walks every parameter);
        # None under torch.compile, which cannot read version counters: a compiled caller checks at its boundary.
        version = None if kv_cache is None or torch.compiler.is_compiling() else weights_version(self)
        if not torch.compiler.is_compiling():  # checks at the boundary; value checks sync with the device
            self.check_inputs(input_ids, labels, memory, kv_cache, ctx, version=version, padding=padding)
        if self.plan.attn_impl == "reference":  # the plain path, the oracle of this one
            return plain.forward(self, input_ids, labels, memory, ctx=ctx, return_log_probs=return_log_probs,
                                 kv_cache=kv_cache, padding=padding, weights_version=version)
        T = input_ids.size(1)
        own, compressed, mems, M = plain.read_memory(self, memory)
        mask = plain.segment_mask(T, M, ctx, padding, input_ids.device)  # (T, K), or (B, 1, T, K) with padding
        h = self.drop(self.embed(input_ids))  # (B, T, d)
        table = () if kv_cache is None else self.encoding.grow_table(  # the cache's W_kR R, grown to K
            [layer.attn for layer in self.layers], kv_cache.positions, M + T, ctx.clamp_len, d_model=c.d_model,
            dtype=h.dtype, device=h.device)
        positions = plain.layer_positions(self, M + T, ctx.clamp_len, h.dtype, self.drop, table)
        # With a cache the memory, keys and values grow in place into its RowBuffers (not with ext_len: rows fed again)
        grow = kv_cache is not None and ctx.mem_len > 0 and ctx.ext_len == 0 and not torch.compiler.is_compiling()
        hiddens, keys, values, buffers = [], [], [], []
        # Under autocast the layers' weights cast by one grouped op (``casting``), the norms' too for a 16-bit input
        with self._cast_weights(kernels.compute_dtype(h), with_norms=h.dtype in (torch.float16, torch.bfloat16)):
            u, v = getattr(self, "u", None), getattr(self, "v", None)
            for l, layer in enumerate(self.layers):
                hiddens.append(h)  # each layer's input, before absolute positions: the next memory
                x, mem = plain.add_absolute(h, mems[l], positions[l], M)
                kv = None
                if kv_cache is not None:  # the memory rows' keys and values read from the cache
                    k, val, grown = cached_keys_values(layer.attn.keys_values, x, mem, kv_cache, l, grow=grow)
                    kv, mem = (k, val), None  # (B, K, H, D) each
                    keys.append(k), values.append(val), buffers.append(grown)
                h = layer(x, mem, mask, positions[l], u, v, kv=kv)
        out = LMOutput(memory=(), hidden=self.drop(h))  # (B, T, d)
        if grow and self.compressor is None:
            self._grow(out, kv_cache, own, hiddens, keys, values, buffers, mem_len=ctx.mem_len, table=table,
                       version=version)
        else:
            plain.next_state(self, out, own, compressed, hiddens, keys, values, ctx=ctx, kv=kv_cache is not None,
                             train=self.training and labels is not None, version=version, table=table,
                             buffers=buffers if grow else None)
        return plain.predict(out, labels, return_log_probs, self.softmax.nll, self.softmax.log_prob)

    def _grow(self, out: LMOutput, cache: KVCache, memory: Memory | None, hiddens: list[torch.Tensor],
              keys: list[torch.Tensor], values: list[torch.Tensor], buffers: list, *, mem_len: int,
              table: tuple[torch.Tensor, ...], version: int | None) -> None:
        """``out.memory`` and ``out.kv_cache`` as views of the cache's RowBuffers, the new rows appended in place
        (``txl.model.memory.grow_memory``): the keys and values of exactly ``out.memory``'s rows."""
        had = [b[0] for b in cache.buffers] if cache.buffers else None
        out.memory, memory_buffers = grow_memory(memory if memory_length(memory) else None, hiddens, mem_len=mem_len,
                                                 buffers=had)
        # keys/values cover all K rows, so keeping their last mem_len keeps them aligned with the memory.
        out.kv_cache = KVCache(keys=tuple(last_rows(k, mem_len) for k in keys),
                               values=tuple(last_rows(val, mem_len) for val in values), positions=table,
                               buffers=tuple((m, *kv) for m, kv in zip(memory_buffers, buffers)),
                               weights_version=version)

    def _cast_weights(self, dtype: torch.dtype, *, with_norms: bool) -> contextlib.AbstractContextManager:
        """Where the layers read their matmul weights (and with ``with_norms`` the norms') cast to ``dtype`` by one
        grouped op (``txl.model.casting``); a no-op without autocast or with 'per_use'."""
        mode = self.plan.cast_weights
        if mode == "per_use" or torch.compiler.is_compiling():  # a compiled graph fuses the casts itself
            return contextlib.nullcontext()
        first = next(self.layers.parameters(), None)
        if first is None or first.dtype == dtype:  # no autocast (the usual float32 run): nothing to walk or cast
            return contextlib.nullcontext()
        slots = casting.matmul_weights(self.layers) + (casting.norm_weights(self.layers) if with_norms else [])
        params = [m._parameters[n] for m, n in slots]
        if not params or any(p.dtype == dtype for p in params) or mode == "auto" and not casting.groupable(
                params, dtype):  # nothing to cast, or 'auto' keeps the casts per use (``casting.groupable``)
            return contextlib.nullcontext()
        return casting.cast_in_place(slots, dtype)

    def check_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                     memory: Memory | None = None, kv_cache: KVCache | None = None,
                     context: Context | None = None, *, version: int | None = None,
                     padding: torch.Tensor | None = None) -> None:
        """Raise a ValueError naming what is wrong with the arguments of ``forward`` (which calls it, except under
        torch.compile). Token ids and labels are range-checked on host tensors only (on a GPU a read is a host sync):
        callers check their data before it moves (``check_token_ids``). ``version``: ``weights_version(self)`` when
        the caller has read it already (None: read here)."""
        c = self.config
        ctx = c.context() if context is None else context
        if not isinstance(ctx, Context):
            raise ValueError(f"context must be a txl.Context (model.config.context(mem_len=...)), "
                             f"got {type(ctx).__name__}")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be a (B, T) integer tensor; got {input_ids.dtype} of shape "
                             f"{tuple(input_ids.shape)} (add a batch dimension with .unsqueeze(0))")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty: pass at least one token")
        on_host = reads_values(input_ids)  # values are read on the host only (the docstring)
        if on_host:
            check_token_ids(input_ids, c.vocab_size)
        B, T = input_ids.shape
        if ctx.ext_len and ctx.ext_len >= T:
            raise ValueError(f"ext_len={ctx.ext_len} must be shorter than the segment ({T} tokens); lower ext_len "
                             "or feed longer segments")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}; labels[:, t] is the token after input_ids[:, t]")
            valid = labels[labels != IGNORE_INDEX] if on_host else labels[:0]
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= c.vocab_size):
                raise ValueError(f"a label is out of range for vocab_size={c.vocab_size} "
                                 f"(use {IGNORE_INDEX} to ignore a position)")
            if on_host:  # 'capacity' rows: a tail holding more labels than its rows, named here (NaN on a device)
                self.softmax.check_rows(labels)
        if memory is not None:  # a compressive model's holds two (split_state checks that it does)
            for part in (memory,) if self.compressor is None else split_state(memory, c.n_layer):
                check_memory(part, n_layer=c.n_layer, batch_size=B, d_model=c.d_model,
                             device=self.embed.layers[0].weight.device)
        if self.compressor is not None and (ctx.same_length or ctx.ext_len or not ctx.mem_len):
            raise ValueError("a compressive model (cmem_len > 0) reads with mem_len >= 1, same_length false and "
                             "ext_len 0: with mem_len 0 nothing is kept to compress from (ModelConfig refuses it too), "
                             "same_length would hide the compressed slots, ext_len feed rows twice")
        # The rows attended to before the segment: a compressive model's window, [compressed; memory].
        own, compressed = (memory, None) if self.compressor is None else split_state(memory, c.n_layer)
        M = memory_length(own) + memory_length(compressed)
        if kv_cache is not None:
            self._check_kv_cache(kv_cache, M, B, version)
        if padding is None:
            return
        if self.compressor is not None and (memory_length(compressed) or M + T - ctx.mem_len >= c.cmem_rate):
            # Pads lead each row; compressed slots before a padded memory would sit after the pads (their
            # distances shifted), and rows leaving would compress pads with real states.
            raise ValueError(f"padding with a compressed memory (cmem_len > 0) needs an empty compressed memory "
                             f"and nothing compressed by this call (memory + segment {M + T} rows, mem_len "
                             f"{ctx.mem_len}, cmem_rate {c.cmem_rate}): pads would be compressed with real rows; "
                             "read rows of different lengths one at a time, or with a mem_len that keeps them all")
        if padding.shape != (B, M + T) or padding.dtype != torch.bool:
            raise ValueError(f"padding must be a (B, M + T) = ({B}, {M + T}) bool tensor over the memory rows "
                             f"and the segment, got {padding.dtype} {tuple(padding.shape)}")

    def _check_kv_cache(self, cache: KVCache, mlen: int, batch_size: int, version: int | None = None) -> None:
        """Raise a ValueError saying why ``cache`` cannot stand for the memory rows' keys and values."""
        c = self.config
        if not isinstance(cache, KVCache):
            raise ValueError(f"kv_cache must be a KVCache (KVCache() to start one), got {type(cache).__name__}")
        if not self.encoding.cacheable:
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
        if cache.weights_version not in (None, weights_version(self) if version is None else version):
            raise ValueError("kv_cache was built with other weights (a parameter changed since): its keys are "
                             "stale; pass KVCache() to rebuild it from the memory")


def reads_values(t: torch.Tensor) -> bool:
    """Whether ``forward`` checks the values of ``t`` (token ids, labels): on the host only, where reading is free."""
    return t.device.type == "cpu"


def check_token_ids(ids: torch.Tensor | np.ndarray, vocab_size: int) -> None:
    """Raise a ValueError if a token id is outside [0, vocab_size): on the host, before the ids move to a device."""
    if (ids.numel() if isinstance(ids, torch.Tensor) else ids.size) == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is out of range for vocab_size={vocab_size}; "
                         "encode with the vocabulary this model was trained with")


__all__ = ["Attention", "DecoderLayer", "FeedForward", "KVCache", "LMOutput", "TransformerXL", "attention_mask"]
