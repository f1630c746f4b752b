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
        if model.config.cmem_len:
            raise ValueError(f"cmem_len={model.config.cmem_len}: a compressed memory cannot be exported as a segment "
                             "step yet (its padded rows would be compressed with real ones); export a model with "
                             "cmem_len 0")
        self.model = model
        self.eval()  # the step is for inference: no dropout

    def forward(self, input_ids: torch.Tensor, memory: torch.Tensor,
                memory_padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T = input_ids.shape
        M = memory.size(2)
        segment_padding = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)  # (B, T)
        padding = torch.cat([memory_padding, segment_padding], dim=1)  # (B, M + T)
        out = self.model(input_ids, memory=list(memory.unbind(0)), padding=padding, return_log_probs=True)
        # The model keeps the last mem_len = M rows of [memory; segment]; so does the padding.
        return out.log_probs, torch.stack(out.memory), padding[:, -M:]  # (B, T, V), (L, B, M, d), (B, M)


def initial_state(model: TransformerXL, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory (L, B, M, d) zeros and padding (B, M) all True of a stream that has read nothing."""
    c = model.config
    device = next(model.parameters()).device
    memory = torch.zeros(c.n_layer, batch_size, c.mem_len, c.d_model, device=device)  # (L, B, M, d)
    return memory, torch.ones(batch_size, c.mem_len, dtype=torch.bool, device=device)  # (B, M)


def _example(model: TransformerXL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    memory, padding = initial_state(model, 2)
    ids = torch.zeros(2, 3, dtype=torch.long, device=memory.device)  # (B, T); B, T >= 2: not specialised
    return ids, memory, padding


def export_program(model: TransformerXL) -> torch.export.ExportedProgram:
    """``torch.export`` of :class:`SegmentStep`, batch and segment length dynamic."""
    batch, seg = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("segment", min=1, max=65536)
    shapes = {"input_ids": {0: batch, 1: seg}, "memory": {1: batch}, "memory_padding": {0: batch}}
    with torch.no_grad():
        return torch.export.export(SegmentStep(model), _example(model), dynamic_shapes=shapes)


def export_onnx(model: TransformerXL, path: str | os.PathLike) -> Path:
    """ONNX of :class:`SegmentStep` (torch.onnx's dynamo exporter), batch and segment length dynamic."""
    try:
        import onnx  # noqa: F401  (the exporter needs it)
    except ImportError as err:
        raise ImportError("ONNX export needs onnx and onnxscript: pip install 'txl[onnx]'") from err
    batch, seg = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("segment", min=1, max=65536)
    shapes = {"input_ids": {0: batch, 1: seg}, "memory": {1: batch}, "memory_padding": {0: batch}}
    path = Path(path)
    # One self-contained file: weights inside the protobuf, which holds up to 2 GiB; a larger model's weights
    # go to the sidecar PATH.data, which onnx_sidecar names and must travel with the .onnx.
    inline = sum(p.numel() * p.element_size() for p in model.parameters()) < ONNX_INLINE_LIMIT
    with torch.no_grad(), _quiet_exporter():
        torch.onnx.export(SegmentStep(model), _example(model), str(path), dynamo=True, dynamic_shapes=shapes,
                          verbose=False, input_names=["input_ids", "memory", "memory_padding"],
                          output_names=["log_probs", "new_memory", "new_padding"], external_data=not inline)
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
