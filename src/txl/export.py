"""Export one segment step of a model as a self-contained program: ``torch.export`` or ONNX.

The exported step is the model's forward with the memory as explicit inputs and outputs (Dai et al. 2019,
section 3.2: each segment reads the previous segment's hidden states, and hands its own on)::

    log_probs, new_memory, new_padding = step(input_ids, memory, memory_padding)

    input_ids       (B, T) int64 token ids; B and T are dynamic
    memory          (L, B, M, d) float32: every layer's memory stacked, M = the model's mem_len (fixed)
    memory_padding  (B, M) bool: True for memory rows that hold nothing yet
    log_probs       (B, T, V) float32 log-probabilities of the next token at every position
    new_memory      (L, B, M, d) the last M rows of [memory; segment], per layer
    new_padding     (B, M) the same rows' padding

A stream starts with ``initial_state(model, B)``: M empty rows, all marked as padding, which no position
attends to (``padding=`` of the model's forward), so the first segment computes exactly what the eager
model computes with ``memory=None``, and later ones what it computes with the memory it handed back. The
memory has a fixed length so that the program has static memory shapes; the padding marks the rows that
are not filled yet. Token ids are not range-checked inside the program (that check reads data): check
them before calling it. Relative and Shaw attention only (absolute encodings shift with the padding).

A compressive model (``cmem_len`` > 0, Rae et al. 2020, ``txl.model.compressive``) carries its compressed memory
too, as two more inputs and outputs::

    log_probs, new_memory, new_padding, new_compressed, new_compressed_padding = step(
        input_ids, memory, memory_padding, compressed, compressed_padding)

    memory              (L, B, S, d), S = mem_len + cmem_rate - 1: the most rows its memory holds (rows leave
                        in whole groups of cmem_rate), real rows last, the rest padding
    compressed          (L, B, C, d), C = cmem_len slots, real slots last, oldest first
    compressed_padding  (B, C) bool: True for slots that hold nothing yet

The eager model's eviction has data-dependent sizes (how many rows leave depends on how many the memory holds);
the exported step has a static form of it that computes the same: every tensor has a fixed size, the counts of
real rows are read from the paddings as tensors, the window [compressed; memory] is packed by a gather so that
its pads come first (their distances then do not matter, as above), the rows that leave are gathered as the
most groups a segment of T can evict ((T + cmem_rate - 1) // cmem_rate, plus one) and compressed, and the groups
that did not leave are dropped by the gather that right-aligns the new compressed memory. Pads hold zeros. The
counts are per row, so rows at different points of their streams step as one batch (the eager model needs equal
lengths). The cost of the static form: every step compresses that many groups, used or not, and gathers the window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from txl.model import TransformerXL
from txl.model.attention import attn_types, either

Format = Literal["torch-export", "onnx"]
FORMATS: tuple[str, ...] = ("torch-export", "onnx")


class SegmentStep(nn.Module):
    """One segment of a TransformerXL with the memory (stacked) and its padding as tensors in and out."""

    def __init__(self, model: TransformerXL) -> None:
        super().__init__()
        if not model.encoding.relative:
            raise ValueError(f"attn_type={model.config.attn_type!r} cannot be exported as a segment step: its absolute "
                             f"positions shift with the empty memory rows; use {either(attn_types(relative=True))}")
        if model.config.mem_len < 1:
            raise ValueError("mem_len=0: the model has no memory to carry; export needs mem_len >= 1")
        self.model = model
        self.eval()  # the step is for inference: no dropout

    def forward(self, input_ids: torch.Tensor, memory: torch.Tensor,
                memory_padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T = input_ids.shape
        M = memory.size(2)
        segment_padding = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)  # (B, T)
        padding = torch.cat([memory_padding, segment_padding], dim=1)  # (B, M + T)
        out = self.model(input_ids, memory=list(memory.unbind(0)), padding=padding, return_log_probs=True)
        # The model keeps the last mem_len = M rows of [memory; segment]; so does the padding. The memory goes out in
        # the dtype it came in (a 16-bit model, or one under autocast, makes 16-bit rows): the state fed back is the
        # state the program was exported for.
        new_memory = torch.stack(out.memory).to(memory.dtype)  # (L, B, M, d)
        return out.log_probs, new_memory, padding[:, -M:]  # (B, T, V), (L, B, M, d), (B, M)


class CompressiveSegmentStep(SegmentStep):
    """One segment of a compressive TransformerXL with both memories (stacked, right-aligned) and their paddings
    as tensors in and out: the static form of the eager model's eviction (see the module docstring)."""

    def forward(self, input_ids: torch.Tensor, memory: torch.Tensor,  # type: ignore[override]
                memory_padding: torch.Tensor, compressed: torch.Tensor, compressed_padding: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.model.config
        B, T = input_ids.shape
        L, _, S, d = memory.shape
        C, c = compressed.size(2), cfg.cmem_rate
        W = C + S  # the window's rows: [compressed; memory]
        device = input_ids.device
        km = S - memory_padding.sum(1)  # (B,) real memory rows (the last km)
        kc = C - compressed_padding.sum(1)  # (B,) real compressed slots (the last kc)
        # The window packed to the right: its real memory rows stay where they are, its real slots move right by
        # the memory's pads, so the eager window [slots; rows] ends the buffer and only pads come before it.
        w = torch.arange(W, device=device)[None, :]  # (1, W)
        src = torch.where(w >= W - km[:, None], w, w - (S - km)[:, None]).clamp(min=0)  # (B, W)
        both = torch.cat([compressed, memory.to(compressed.dtype)], dim=2)  # (L, B, W, d)
        packed = both.gather(2, src[None, :, :, None].expand(L, B, W, d))  # (L, B, W, d)
        padding = torch.cat([w < (W - km - kc)[:, None], torch.zeros(B, T, dtype=torch.bool, device=device)], 1)
        # The model reads the packed window as its memory with an empty compressed one and a context that keeps
        # every row (2^30: more than the window and the longest segment the program takes): nothing is compressed
        # inside (padding is allowed then), the state out is [window; segment]'s layer inputs, which the eviction
        # below reads.
        state = (*packed.unbind(0), *(packed[l][:, :0] for l in range(L)))  # 2L: memory (B, W, d), empty (B, 0, d)
        out = self.model(input_ids, memory=state, padding=padding, return_log_probs=True,
                         context=cfg.context(mem_len=1 << 30))
        rows = torch.stack(out.memory[:L])  # (L, B, W + T, d)
        # Rae et al. 2020 as txl.model.compressive.evict: of the km + T rows of [memory; segment] the oldest
        # floor((km + T - mem_len) / c) x c leave, compressed c to one slot.
        n = (km + T - cfg.mem_len).clamp(min=0) // c * c  # (B,) rows leaving
        g = n // c  # (B,) new slots
        # The most slots one segment of T makes (km <= S), plus one never kept: G >= 2 for every T, so that the
        # program is not specialised to G == 1 (a size-1 dimension broadcasts: torch.export would have to guard it).
        G = (S + T - cfg.mem_len) // c + 1
        j = torch.arange(G * c, device=device)[None, :]  # (1, G c)
        take = ((W - km)[:, None] + j).clamp(max=W + T - 1)  # (B, G c): from the first real memory row on
        leaving = rows.gather(2, take[None, :, :, None].expand(L, B, G * c, d))  # (L, B, G c, d)
        slots = self.model.compressor(leaving.reshape(L * B, G * c, d)).view(L, B, G, d)  # (L, B, G, d)
        # [old slots; new slots]: the real ones are contiguous, at C - kc .. C + g; the last C of them are kept.
        grown = torch.cat([compressed, slots.to(compressed.dtype)], dim=2)  # (L, B, C + G, d)
        s = torch.arange(C, device=device)[None, :]  # (1, C)
        new_compressed = grown.gather(2, (g[:, None] + s)[None, :, :, None].expand(L, B, C, d))  # (L, B, C, d)
        new_compressed_padding = s < (C - (kc + g).clamp(max=C))[:, None]  # (B, C)
        # The memory keeps the last km + T - n rows: within the last S rows of [window; segment].
        new_memory = rows[:, :, W + T - S:].to(memory.dtype)  # (L, B, S, d): in the dtype it came in
        new_padding = torch.arange(S, device=device)[None, :] < (S - (km + T - n))[:, None]  # (B, S)
        return (out.log_probs, new_memory.masked_fill(new_padding[None, :, :, None], 0), new_padding,
                new_compressed.masked_fill(new_compressed_padding[None, :, :, None], 0), new_compressed_padding)


def segment_step(model: TransformerXL) -> SegmentStep:
    """The exported module of ``model``: :class:`CompressiveSegmentStep` for a compressive one (cmem_len > 0)."""
    return CompressiveSegmentStep(model) if model.config.cmem_len else SegmentStep(model)


def state_names(model: TransformerXL) -> tuple[list[str], list[str]]:
    """The exported step's input and output names."""
    if model.config.cmem_len:
        return (["input_ids", "memory", "memory_padding", "compressed", "compressed_padding"],
                ["log_probs", "new_memory", "new_padding", "new_compressed", "new_compressed_padding"])
    return ["input_ids", "memory", "memory_padding"], ["log_probs", "new_memory", "new_padding"]


def initial_state(model: TransformerXL, batch_size: int) -> tuple[torch.Tensor, ...]:
    """The state of a stream that has read nothing: memory (L, B, M, d) zeros and padding (B, M) all True; for a
    compressive model M = mem_len + cmem_rate - 1, then compressed (L, B, C, d) zeros and its padding (B, C). The
    memories in the parameters' dtype (a 16-bit model's state is 16-bit, the dtype its step returns)."""
    c = model.config
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    M = c.mem_len + c.cmem_rate - 1 if c.cmem_len else c.mem_len
    memory = torch.zeros(c.n_layer, batch_size, M, c.d_model, device=device, dtype=dtype)  # (L, B, M, d)
    padding = torch.ones(batch_size, M, dtype=torch.bool, device=device)  # (B, M)
    if not c.cmem_len:
        return memory, padding
    compressed = torch.zeros(c.n_layer, batch_size, c.cmem_len, c.d_model, device=device, dtype=dtype)  # (L, B, C, d)
    return memory, padding, compressed, torch.ones(batch_size, c.cmem_len, dtype=torch.bool, device=device)


def _example(model: TransformerXL) -> tuple[torch.Tensor, ...]:
    state = initial_state(model, 2)
    ids = torch.zeros(2, 3, dtype=torch.long, device=state[0].device)  # (B, T); B, T >= 2: not specialised
    return ids, *state


def _dynamic_shapes(model: TransformerXL) -> dict[str, dict]:
    batch, seg = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("segment", min=1, max=65536)
    shapes = {"input_ids": {0: batch, 1: seg}, "memory": {1: batch}, "memory_padding": {0: batch}}
    if model.config.cmem_len:
        shapes.update(compressed={1: batch}, compressed_padding={0: batch})
    return shapes


def export_program(model: TransformerXL) -> torch.export.ExportedProgram:
    """``torch.export`` of :func:`segment_step`, batch and segment length dynamic."""
    with torch.no_grad():
        return torch.export.export(segment_step(model), _example(model), dynamic_shapes=_dynamic_shapes(model))


def export_onnx(model: TransformerXL, path: str | os.PathLike) -> Path:
    """ONNX of :func:`segment_step` (torch.onnx's dynamo exporter), batch and segment length dynamic."""
    try:
        import onnx  # noqa: F401  (the exporter needs it)
    except ImportError as err:
        raise ImportError("ONNX export needs onnx and onnxscript: pip install 'txl[onnx]'") from err
    path = Path(path)
    # One self-contained file: weights inside the protobuf, which holds up to 2 GiB; a larger model's weights
    # go to the sidecar PATH.data, which onnx_sidecar names and must travel with the .onnx.
    inline = sum(p.numel() * p.element_size() for p in model.parameters()) < ONNX_INLINE_LIMIT
    with torch.no_grad(), _quiet_exporter():
        inputs, outputs = state_names(model)
        torch.onnx.export(segment_step(model), _example(model), str(path), dynamo=True,
                          dynamic_shapes=_dynamic_shapes(model), verbose=False, input_names=inputs,
                          output_names=outputs, external_data=not inline)
    return path


ONNX_INLINE_LIMIT = 1 << 30  # bytes of weights kept inside the .onnx (protobuf's own limit is 2 GiB)


def onnx_sidecar(path: str | os.PathLike) -> Path | None:
    """The external-weights file an ONNX export wrote beside ``path`` (models over ONNX_INLINE_LIMIT), or None."""
    data = Path(f"{path}.data")
    return data if data.is_file() else None


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's progress chatter (a hundred 'Replaced initializer' / constant-folding lines, torchvision
    notices, deprecation warnings) is not the user's business: warnings and errors still show."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def load(path: str | os.PathLike) -> nn.Module:
    """The segment step saved by ``export(..., format="torch-export")``, callable as ``step(ids, memory,
    padding)`` (under ``torch.no_grad()``: the program is for inference)."""
    step = torch.export.load(str(path)).module()
    for p in step.parameters():
        p.requires_grad_(False)
    return step


def export(model: TransformerXL, path: str | os.PathLike, *, format: Format = "torch-export") -> Path:
    """Write the segment step to ``path`` (.pt2 for torch-export, .onnx for onnx); returns the path."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is unknown; choose one of {', '.join(FORMATS)}")
    path = Path(path)
    if not path.parent.is_dir():  # the output rule of every command: a missing directory is not created
        raise FileNotFoundError(f"{path}: the directory {path.parent} does not exist; create it first")
    if format == "onnx":
        return export_onnx(model, path)
    program = export_program(model)
    # Written through a file object: given a name, torch warns unless it ends in .pt2, and a command writes to a
    # temporary name (fileio.atomic_write) that must not.
    with open(path, "wb") as f:
        torch.export.save(program, f)
    return path
