"""Static-shape steps for CUDA graphs: every training and evaluation step at one shape, captured once, replayed.

Shape legend: B batch, T segment length, M the memory rows a caller holds, S = mem_len the static memory
length, K = S + T keys, d d_model, H heads, D head width, L layers.

On a GPU an eager Transformer-XL step is host-bound: the host launches ~2,000 kernels a training step and
the GPU waits on it (issue 34: 129 ms of host time for 39 ms of device time on an H200). A CUDA graph
replays the whole step's kernels in one launch, but only at the shapes, addresses and control flow it was
captured with, and the model's shapes change: the first segment has no memory, the memory grows by T a
segment until it holds mem_len rows, the key/value cache and the positional table grow with it.

``StaticSteps`` makes every call the same shape: the memory (and the key/value cache) always has S =
mem_len rows, the rows a caller does not have yet being zeros that no query sees (the model's ``padding``
mask, True on them), and the positional table is built for K = S + T distances once. Relative attention
depends on distances alone (Dai et al. 2019, section 3.3), so hiding rows changes no visible score: the
result equals the plain call's up to the order of float sums (the tests). The caller's memory stays what the
plain model returns (the real rows alone, up to mem_len), so checkpoints, resumption and the training state
never see the padding. The calls go through ``torch.compile(mode="reduce-overhead", dynamic=False)``: on
CUDA, inductor's kernels captured as CUDA graphs (forward and backward); on a CPU the same static-shape
graph without CUDA graphs (none exist there).

What a CUDA graph writes, it writes into its own buffers, which its next replay overwrites: the memory,
cache, loss and per-token NLL a caller keeps are copied out of them (a copy of the memory per step, small
beside the step); ``hidden`` and ``log_probs`` are the graph's own, valid until the next call.

Evaluation (``txl.evaluate(graphs=True)``, ``txl score``) runs over key/value rings instead where it can
(``txl.static_eval``: nothing copied in or out); what those cannot take comes here.

The optimiser step stays outside the graphs: ``txl.optim.build_optimizer``'s fused Adam is a few
multi-tensor kernels whatever the parameter count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from txl.config import Context
from txl.model import KVCache, LMOutput, TransformerXL
from txl.model.memory import Memory, memory_length


def static_shape_error(config) -> str | None:
    """Why ``config``'s model cannot run at static shapes (None: it can): the unfilled memory rows are hidden by
    the padding mask, which needs scores that depend on distances alone and a memory the mask covers."""
    from txl.model.attention import encoding

    if not encoding(config.attn_type).relative:
        return (f"static shapes hide the memory rows not yet filled, which needs an encoding whose scores depend on "
                f"distances alone; attn_type={config.attn_type!r} adds absolute positions")
    if getattr(config, "cmem_len", 0):
        return (f"static shapes hide the memory rows not yet filled with the padding mask, which a compressed "
                f"memory (cmem_len={config.cmem_len}) does not take")
    return None


def memory_dtype(core: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the model keeps its memory in: its parameters' (under autocast too: the memory is the float32
    residual stream's rows; ``device`` is kept for callers that ask per device)."""
    return next(core.parameters()).dtype


def compile_static(model: torch.nn.Module, backend: str | None = None) -> Callable[..., LMOutput]:
    """``torch.compile`` at static shapes, with CUDA graphs where the backend is inductor (the default)."""
    if backend is None:
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    return torch.compile(model, backend=backend, dynamic=False)


def _left_padded(rows: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, M, ...) -> (B, length, ...) in ``dtype``: zeros before the M rows (the rows the caller has not yet)."""
    B, M = rows.shape[:2]
    if M == length:
        return rows.to(dtype)
    pad = rows.new_zeros((B, length - M, *rows.shape[2:]), dtype=dtype)  # (B, length - M, ...)
    return torch.cat([pad, rows.to(dtype)], dim=1)  # (B, length, ...)


def _kept(rows: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The last ``n`` rows of a graph's output, copied out of its buffer (the next replay overwrites it)."""
    return rows[:, rows.size(1) - n:].to(dtype, memory_format=torch.contiguous_format, copy=True)


class StaticSteps:
    """The model's forward at one static shape per segment length: call it as the model is called
    (``steps(x, labels=y, memory=memory)``; in evaluation also ``kv_cache=``, ``context=``).

    ``model``: a ``TransformerXL`` or a wrapper of one whose forward takes the model's arguments (DDP);
    ``compile``: run through ``compile_static`` (False: the same static shapes eagerly, what the CPU tests
    compare); ``backend``: torch.compile's backend (None: inductor with CUDA graphs; the tests use 'aot_eager').
    ``memory_dtype``: the dtype the memory is held in between calls (None: the model's own, the parameters'
    dtype); a memory returned in
    another dtype is cast, so every call sees one dtype (one graph).

    The first segment length seen is the static one; a segment of another length (the last, shorter segment
    of an evaluation; ``var_len`` training) runs on the plain model, uncompiled, with the same result.
    """

    def __init__(self, model: torch.nn.Module, *, compile: bool = True, backend: str | None = None,
                 memory_dtype: torch.dtype | None = None) -> None:
        core = getattr(model, "module", model)  # DDP's wrapped model
        if not isinstance(core, TransformerXL):
            raise ValueError(f"StaticSteps needs a TransformerXL (or DDP of one), got {type(core).__name__}")
        why = static_shape_error(core.config)
        if why is not None:
            raise ValueError(f"{why}: turn graphs off (--train.graphs off / --eval.graphs false)"
                             + (", or set cmem_len 0" if getattr(core.config, "cmem_len", 0) else ""))
        self.model, self.core = model, core
        self.forward = compile_static(model, backend) if compile else model
        self.compiled = compile
        self.memory_dtype = memory_dtype
        self.tgt_len: int | None = None
        self._padding: dict[tuple, torch.Tensor] = {}

    def state_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the memory is kept in: ``memory_dtype``, or the model's."""
        return memory_dtype(self.core, device) if self.memory_dtype is None else self.memory_dtype

    def no_sync(self):
        """DDP's ``no_sync`` (gradient accumulation), as ``txl.parallel.no_sync`` asks the model for it."""
        return self.model.no_sync()

    def padding(self, batch: int, length: int, tgt_len: int, filled: int, device: torch.device) -> torch.Tensor:
        """(B, S + T) bool, True on the S - filled memory rows nobody has yet; one tensor per fill level,
        made once (a graph's inputs are copied into its own buffers, so a shared tensor is safe)."""
        key = (batch, length, tgt_len, filled, device)
        if key not in self._padding:
            pad = torch.zeros(batch, length + tgt_len, dtype=torch.bool, device=device)  # (B, S + T)
            pad[:, :length - filled] = True
            self._padding[key] = pad
        return self._padding[key]

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, memory: Memory | None = None,
                 *, kv_cache: KVCache | None = None, context: Context | None = None,
                 return_log_probs: bool | None = None) -> LMOutput:
        c = self.core.config
        ctx = c.context() if context is None else context
        S = ctx.mem_len
        B, T = input_ids.shape
        if self.tgt_len is None:
            self.tgt_len = T
        M = memory_length(memory)
        if ctx.ext_len:
            raise ValueError(f"static shapes need ext_len 0 (ext_len={ctx.ext_len} re-feeds rows each segment); "
                             "turn graphs off or set ext_len 0")
        if M > S:
            raise ValueError(f"the memory holds {M} rows, more than mem_len={S}; pass the memory this model "
                             "returned, or None")
        if T != self.tgt_len or S == 0:  # another shape than the captured one: the plain model, same result
            return self.model(input_ids, labels=labels, memory=memory, kv_cache=kv_cache, context=context,
                              return_log_probs=return_log_probs)
        if self.compiled:
            self.core.check_inputs(input_ids, labels, memory, kv_cache, ctx)  # compiled callers check here
        device, n_layer, d = input_ids.device, c.n_layer, c.d_model
        mem_dtype = self.state_dtype(device)
        if memory is None or M == 0:
            memory = tuple(torch.zeros(B, 0, d, device=device, dtype=mem_dtype) for _ in range(n_layer))
        static_memory = tuple(_left_padded(m, S, mem_dtype) for m in memory)  # (B, S, d) each
        cache = None if kv_cache is None else self._static_cache(kv_cache, memory, S, T, ctx, device)
        padding = self.padding(B, S, T, M, device)  # (B, S + T)
        if self.compiled and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the previous replay's buffers may be reused
        out = self.forward(input_ids, labels=labels, memory=static_memory, kv_cache=cache, context=ctx,
                           padding=padding, return_log_probs=return_log_probs)
        filled = min(M + T, S)
        kept = dict(memory=tuple(_kept(m, filled, mem_dtype) for m in out.memory))
        if out.loss is not None:
            kept.update(loss=out.loss.clone(), nll=out.nll.clone(), tokens=out.tokens.clone())
        if cache is not None:
            dtype = cache.keys[0].dtype
            kept["kv_cache"] = KVCache(keys=tuple(_kept(k, filled, dtype) for k in out.kv_cache.keys),
                                       values=tuple(_kept(v, filled, dtype) for v in out.kv_cache.values),
                                       positions=cache.positions, weights_version=out.kv_cache.weights_version)
        return dataclasses.replace(out, **kept)

    def _static_cache(self, cache: KVCache, memory: Memory, S: int, T: int, ctx: Context,
                      device: torch.device) -> KVCache:
        """The cache at S rows (zeros before the M real ones) with the positional table built for K = S + T."""
        core = self.core
        attns = [layer.attn for layer in core.layers]
        table = core.encoding.grow_table(attns, cache.positions, S + T, ctx.clamp_len, d_model=core.config.d_model,
                                         dtype=next(core.parameters()).dtype, device=device)
        if not cache.keys:  # the memory's rows (none on a first segment) projected once, here, as the model would
            keys, values = zip(*(a.keys_values(m) for a, m in zip(attns, memory)))  # (B, M, H, D) each
        else:
            keys, values = cache.keys, cache.values
        dtype = keys[0].dtype
        return KVCache(keys=tuple(_left_padded(k, S, dtype) for k in keys),
                       values=tuple(_left_padded(v, S, dtype) for v in values), positions=table,
                       weights_version=cache.weights_version)


__all__ = ["StaticSteps", "compile_static", "memory_dtype", "static_shape_error"]
