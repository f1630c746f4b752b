"""The whole training step as one CUDA graph: forward, backward, clipping, the optimiser's step and the memory handed
to the next step, captured once and replayed (``TrainConfig.graphs='step'``, the default on CUDA).

Shape legend: B this process's streams, A accumulation chunks, b = B / A a chunk's streams, T segment length,
S = mem_len memory rows, d d_model, L layers.

Why: an eager step on a GPU is host-bound (issue 34: 129 ms of host time for 39 ms of device time on an H200), and
graphing the forward and backward alone (``txl.graphs``, 'model') still leaves the host to launch clipping, the
optimiser, the scaler and the copies of the memory in and out of the graphs' buffers, kernel by kernel. Here one
replay launches the whole step.

A CUDA graph replays fixed kernels on fixed addresses, so everything the step reads or writes lives in buffers made
once (``StepGraph.static``): the inputs and labels (written in place before each replay), each chunk's memory at
S rows (those not filled yet hidden by the model's ``padding`` mask, as in ``txl.graphs``: relative attention depends
on distances alone, Dai et al. 2019, section 3.3), the padding masks, the learning rate (a 0-d tensor on the
device, so the schedule changes no kernel argument) and the step's figures (loss, scored tokens, gradient norm),
which the trainer reads at its log interval only. The optimiser is built ``capturable`` (its step counts and
learning rate on the device) and fused, and fp16's ``GradScaler`` skips a non-finite step inside the fused kernel
(``found_inf``), so nothing in the step waits on the host. The step itself is ``txl.train.train_step``, unchanged:
the graph records what it launches.

On CUDA the first ``warmup`` steps run uncaptured on a side stream (torch.compile's kernels are made, the
optimiser's state allocated), the next is captured and replayed; every later step is one replay. Nothing of the
graph outlives the object: a resumed run builds its own after the checkpoint is loaded. On a CPU there is nothing
to capture: the same static-shape step runs through torch.compile (or eagerly), which is what the CPU tests check
(one graph, no recompilation, the buffers' addresses fixed, no host sync inside the step).

The memory handed back (``TrainState.memories``, checkpointed) is each buffer's filled rows, a view: a memory that
is not the one handed out last (a resumed run's, a new epoch's None) is copied in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from txl.graphs import memory_dtype, static_shape_error
from txl.model.memory import Memory, memory_length
from txl.model.plan import resolved
from txl.static_eval import on_side_stream
from txl.step_stats import StepStats

log = logging.getLogger(__name__)

WARMUP_STEPS = 3
"""Uncaptured steps before the capture on CUDA (torch's recipe for whole-network capture: compile, allocate the
optimiser's state and let autograd settle its streams first)."""


def compile_step_model(model: torch.nn.Module, backend: str | Callable | None = None) -> Callable[..., Any]:
    """The model of a captured step through torch.compile at static shapes, without torch's own CUDA graphs (the step
    is captured whole around it); ``backend``: torch.compile's (None: inductor)."""
    return torch.compile(model, backend=backend or "inductor", dynamic=False)


def graphs_mode(cfg: Any, device: torch.device, world_size: int) -> tuple[str, str | None]:
    """``TrainConfig.graphs`` as this run resolves it: ('step' | 'model' | 'off', why a captured step does not apply,
    or None). 'auto' goes through ``txl.model.plan``'s table ('step' on CUDA, 'off' elsewhere)."""
    t, m = cfg.train, cfg.model
    mode = resolved("graphs", t.graphs, device.type)
    if mode != "step":
        return mode, None
    why = None
    if t.var_len:
        why = "var_len changes the segment length every step (a graph has one shape)"
    elif t.parallel == "fsdp":
        why = "FSDP2 gathers and frees parameters every step, which a replayed graph cannot follow"
    elif world_size > 1:
        why = (f"{world_size} processes: DDP inside a captured step needs torch's side-stream construction and 11 "
               "eager warm-up steps, not verified here")
    elif t.activation_checkpointing:
        why = "activation checkpointing saves and restores the RNG state on the host inside the backward"
    elif m.ext_len:
        why = f"ext_len={m.ext_len} re-feeds rows each segment (a static memory has no room for them)"
    elif not m.mem_len:
        why = "mem_len 0: nothing is carried, the plain step is already static"
    else:
        why = static_shape_error(m)
    if why is None:
        return "step", None
    # 'model' (txl.graphs) takes what it can: DDP, var_len (a plain call per other length); otherwise eager.
    fallback = "model" if (t.graphs == "step" and static_shape_error(m) is None and not m.ext_len
                           and t.parallel != "fsdp") else "off"
    return fallback, why


class StepGraph:
    """``train_step`` over static buffers, captured as one CUDA graph (``capture``, default: on CUDA) or, on a CPU,
    run as it is with the model through torch.compile at static shapes (``compile``; ``backend``: torch.compile's,
    None for inductor). Call it as ``train_step`` is called, with ``lr`` a float: ``(StepStats, memories)``.

    ``step``: the step recorded (``txl.train.train_step``, handed in by the trainer that builds this object);
    ``model``: the TransformerXL the step trains; ``optimizer`` its optimiser (on CUDA built ``capturable``:
    ``txl.optim.build_optimizer(..., capturable=True)``); ``step_options``: ``train_step``'s keywords (clip,
    precision, info, loss_positions). A batch of another shape than the first (none in a run without var_len)
    runs the plain ``train_step``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, *,
                 capture: bool | None = None, compile: bool = True, backend: str | Callable | None = None,
                 step: Callable[..., Any], warmup: int = WARMUP_STEPS, **step_options: Any) -> None:
        why = static_shape_error(model.config) or (f"ext_len={model.config.ext_len}" if model.config.ext_len else None)
        if why is not None:
            raise ValueError(f"the captured training step needs static shapes: {why}; use --train.graphs off")
        device = next(model.parameters()).device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and step_options.get("precision") == "fp16" and not getattr(
                optimizer, "_step_supports_amp_scaling", False):
            raise ValueError("fp16 in a captured step needs a fused optimiser (GradScaler skips a non-finite step "
                             "inside its kernel; otherwise it reads found_inf on the host): use --train.graphs model")
        if self.capture and not compile and resolved("cluster_rows", model.compute.cluster_rows, "cuda") == "selected":
            raise ValueError("cluster_rows='selected' reads each tail cluster's row count on the host (nonzero), "
                             "which a captured step cannot: compile its model (torch.compile keeps every row), or "
                             "set --compute.cluster_rows all")
        self.model, self.optimizer, self.scaler, self.device = model, optimizer, scaler, device
        self.train_step, self.options, self.warmup = step, step_options, warmup
        self.forward = compile_step_model(model, backend) if compile else model
        self.lr = torch.zeros((), dtype=torch.float32, device=device)  # written before each step, read on the device
        self.static: dict[str, Any] | None = None  # the buffers, made by the first step
        self.handed: list[Memory | None] = []  # the memories last handed out (views of the buffers)
        self.filled: list[int] = []  # each chunk's real memory rows
        self.graph: torch.cuda.CUDAGraph | None = None
        self.runs = 0  # steps run through the buffers (warm-up ones included)

    # -- the buffers --------------------------------------------------------------------------------------------

    def _allocate(self, input_ids: torch.Tensor, chunks: int) -> None:
        c = self.model.config
        B, T = input_ids.shape
        S, b = c.mem_len, B // chunks
        from txl.evaluate import autocast

        with autocast(self.device, self.options["precision"]):
            dtype = memory_dtype(self.model, self.device)
        memory = [tuple(torch.zeros(b, S, c.d_model, dtype=dtype, device=self.device) for _ in range(c.n_layer))
                  for _ in range(chunks)]  # A x L x (b, S, d)
        self.static = {
            "input_ids": torch.zeros(B, T, dtype=input_ids.dtype, device=self.device),  # (B, T)
            "labels": torch.zeros(B, T, dtype=torch.int64, device=self.device),  # (B, T)
            "memory": memory,
            "padding": [torch.ones(b, S + T, dtype=torch.bool, device=self.device) for _ in range(chunks)],
            "stats": torch.zeros(3, dtype=torch.float64, device=self.device),  # loss, tokens, grad norm
        }
        self.chunk_of = {id(m): a for a, m in enumerate(memory)}
        self.handed, self.filled = [None] * chunks, [0] * chunks
        self.pad_fill = [-1] * chunks  # the fill each padding buffer encodes

    def _take(self, a: int, memory: Memory | None) -> None:
        """Chunk ``a``'s memory into its buffers (zeros before its M rows), unless it is the one handed out."""
        if self.handed[a] is not None and memory is self.handed[a]:
            return
        S, M = self.model.config.mem_len, memory_length(memory)
        if M > S:
            raise ValueError(f"the memory holds {M} rows, more than mem_len={S}; pass the memory the step returned")
        for l, buf in enumerate(self.static["memory"][a]):
            buf[:, :S - M].zero_()
            if M:
                buf[:, S - M:].copy_(memory[l])
        self.filled[a] = M

    def _hand_out(self, a: int) -> Memory:
        S, n = self.model.config.mem_len, self.filled[a]
        self.handed[a] = tuple(buf[:, S - n:] for buf in self.static["memory"][a])  # L x (b, n, d), views
        return self.handed[a]

    def _set_padding(self, a: int) -> None:
        """Chunk ``a``'s mask for its fill, rewritten only when the fill changed (the first S / T steps)."""
        S, n = self.model.config.mem_len, self.filled[a]
        if self.pad_fill[a] == n:
            return
        pad = self.static["padding"][a]  # (b, S + T): True on the S - n rows nobody has yet
        pad.zero_()
        pad[:, :S - n] = True
        self.pad_fill[a] = n

    # -- the step -----------------------------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, memory: Memory | None = None):
        """What ``train_step`` calls as the model: the chunk's static memory with its padding mask."""
        padding = self.static["padding"][self.chunk_of[id(memory)]]
        return self.forward(input_ids, labels=labels, memory=memory, padding=padding)

    def body(self) -> None:
        """One step over the buffers: what the graph records. Writes the parameters, the optimiser's and scaler's
        state, each chunk's memory buffers and the figures; reads nothing back on the host."""
        from txl.data import Batch

        s = self.static
        batch = Batch(s["input_ids"], s["labels"], context_len=0, start=1)
        stats, memories = self.train_step(self._forward, self.optimizer, self.scaler, batch, list(s["memory"]),
                                          lr=self.lr, **self.options)
        for bufs, new in zip(s["memory"], memories):
            for buf, m in zip(bufs, new):
                buf.copy_(m)  # the memory handed to the next step, in place
        figures = [stats.loss, stats.tokens, stats.grad_norm]
        s["stats"].copy_(torch.stack([torch.as_tensor(v, device=self.device).double().reshape(()) for v in figures]))

    def _run(self) -> None:
        """The body as this step runs it: plainly (CPU), warming up on a side stream, captured, or replayed."""
        if not self.capture:
            self.body()
        elif self.graph is not None:
            self.graph.replay()
        elif self.runs < self.warmup:
            on_side_stream(self.body, self.device)
        else:
            for group in self.optimizer.param_groups:  # a resumed optimiser's groups carry the saved flag
                group["capturable"] = True
            self.optimizer.zero_grad(set_to_none=True)  # the backward's first write makes each .grad in the graph
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.body()
            except RuntimeError as err:  # something in the step cannot be captured: run on uncaptured, say why
                # A capture runs nothing on the device, so the weights are as before it: the step runs again.
                log.warning("the training step could not be captured as a CUDA graph (%s); it runs uncaptured from "
                            "here on (--train.graphs model or off choose another way)", str(err).splitlines()[0])
                self.capture = False
                self.optimizer.zero_grad(set_to_none=True)
                getattr(self.scaler, "_per_optimizer_states", {}).clear()  # a step cut off inside the scaler's stages
                self.body()
            else:
                self.graph = graph
                graph.replay()  # the capture recorded the step; this runs it
        self.runs += 1

    def __call__(self, batch: Any, memories: list[Memory | None], *, lr: float) -> tuple[Any, list[Memory | None]]:
        chunks = len(memories)
        if batch.context_len:
            raise ValueError("the captured training step needs ext_len 0; use --train.graphs off")
        if self.static is None:
            self._allocate(batch.input_ids, chunks)
        s = self.static
        if batch.input_ids.shape != s["input_ids"].shape or chunks != len(s["memory"]):
            # Another shape than the captured one: the plain step, on the real rows of each memory.
            for a, m in enumerate(memories):
                if m is not None and m is self.handed[a]:
                    memories[a] = tuple(t.clone() for t in m)  # the buffers are overwritten by the next replay
            self.handed = [None] * len(s["memory"])
            return self.train_step(self.model, self.optimizer, self.scaler, batch, memories, lr=lr, **self.options)
        for a, m in enumerate(memories):
            self._take(a, m)
            self._set_padding(a)
        s["input_ids"].copy_(batch.input_ids)
        s["labels"].copy_(batch.labels)
        self.lr.fill_(lr)
        self._run()
        T, S = batch.input_ids.size(1), self.model.config.mem_len
        out = []
        for a in range(chunks):
            self.filled[a] = min(self.filled[a] + T, S)
            out.append(self._hand_out(a))
        figures = s["stats"].clone()  # (3,): the next replay overwrites the buffer
        loss, tokens, grad_norm = figures.unbind()
        return StepStats(loss, tokens, lr, grad_norm), out


def with_float_lr(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimiser state dict whose learning rates are floats (the captured step keeps its own as a device tensor;
    a checkpoint keeps the number, so any run resumes it)."""
    groups = [dict(g, lr=float(g["lr"])) if isinstance(g.get("lr"), torch.Tensor) else g
              for g in optimizer_state["param_groups"]]
    return {**optimizer_state, "param_groups": groups}


__all__ = ["WARMUP_STEPS", "StepGraph", "compile_step_model", "graphs_mode", "with_float_lr"]
