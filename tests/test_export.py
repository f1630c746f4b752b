"""Export of one segment step: the exported program's log-probabilities and memories equal the eager
model's over three segments of different lengths, at another batch size than the one traced."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
from txl.cli import main
from txl.export import SegmentStep, initial_state, load

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

SEGMENTS = (4, 1, 7)  # longer than mem_len 6 at the end: the memory is cut to its last 6 rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    # A tail cluster (the exported graph holds the adaptive softmax's) and clamp_len below the keys' length.
    model = txl.TransformerXL(tiny_config(cutoffs=[20], div_val=2, clamp_len=7))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return txl.save_pretrained(model, tmp_path_factory.mktemp("model"))


def check_against_eager(model, step) -> None:
    """Three segments through ``step`` (numpy or torch in, out) from initial_state vs eager from memory=None."""
    B, M = 3, model.config.mem_len
    memory, padding = initial_state(model, B)
    eager_memory = None
    torch.manual_seed(1)
    for T in SEGMENTS:
        ids = torch.randint(0, model.config.vocab_size, (B, T))
        log_probs, memory, padding = step(ids, memory, padding)
        with torch.no_grad():
            out = model(ids, memory=eager_memory, return_log_probs=True)
        eager_memory = out.memory
        torch.testing.assert_close(log_probs, out.log_probs, atol=2e-6, rtol=1e-5)
        filled = out.memory[0].size(1)  # the eager memory grows to mem_len; the exported one is padded
        assert padding.tolist() == [[True] * (M - filled) + [False] * filled] * B
        for layer in range(model.config.n_layer):
            torch.testing.assert_close(memory[layer][:, M - filled:], out.memory[layer], atol=2e-6, rtol=1e-5)


def test_torch_export_equals_eager_over_three_segments(model_dir, tmp_path, capsys):
    warned = []  # torch's own loggers do not propagate to the root (caplog): listen on torch.export's
    listener = logging.Handler(logging.WARNING)
    listener.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("torch.export").addHandler(listener)
    try:
        assert main(["export", "--checkpoint", str(model_dir), "--format", "torch-export",
                     "-o", str(tmp_path / "step.pt2")]) == 0
    finally:
        logging.getLogger("torch.export").removeHandler(listener)
    assert "inputs input_ids (B, T) int64, memory (2, B, 6, 32) float32" in capsys.readouterr().out
    assert not warned  # torch warned naming the temporary file the command writes first
    step = load(tmp_path / "step.pt2")
    model = txl.from_pretrained(model_dir)

    def run(ids, memory, padding):
        with torch.no_grad():
            return step(ids, memory, padding)

    check_against_eager(model, run)
    # The module that was exported computes the same, eagerly.
    check_against_eager(model, lambda *a: SegmentStep(model)(*a))


def test_onnx_equals_eager_over_three_segments(model_dir, tmp_path, capfd):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    (tmp_path / "out").mkdir()  # export writes into an existing directory (the output rule) and nothing beside
    assert main(["export", "--checkpoint", str(model_dir), "--format", "onnx", "-o", str(tmp_path / "out" /
                 "s.onnx")]) == 0
    out, err = capfd.readouterr()
    assert err == "" and out.startswith(f"{tmp_path / 'out' / 's.onnx'}: one segment step (onnx)")  # no chatter
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["s.onnx"]  # one file, no s.onnx.data
    (tmp_path / "out" / "s.onnx").rename(tmp_path / "shipped.onnx")  # it travels alone
    session = ort.InferenceSession(str(tmp_path / "shipped.onnx"))

    def run(ids, memory, padding):
        outs = session.run(None, {"input_ids": ids.numpy(), "memory": np.asarray(memory),
                                  "memory_padding": np.asarray(padding)})
        return tuple(torch.from_numpy(o) for o in outs)

    check_against_eager(txl.from_pretrained(model_dir), run)


def test_onnx_of_a_large_model_names_its_weights_file(model_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import txl.export

    monkeypatch.setattr(txl.export, "ONNX_INLINE_LIMIT", 0)  # as if the weights were over 1 GiB
    assert main(["export", "--checkpoint", str(model_dir), "--format", "onnx", "-o", str(tmp_path / "s.onnx")]) == 0
    assert (tmp_path / "s.onnx.data").is_file()
    assert f"{tmp_path / 's.onnx.data'}: the weights (over 1 GiB, too large to keep inside s.onnx); ship it beside " \
        "s.onnx" in capsys.readouterr().out


def test_rotary_segment_step_exports_and_equals_eager(tmp_path):
    """Rotary positions rotate by the index in [memory; segment]: the padded memory of the exported step shifts
    those indices, which relative scores do not see, so the exported program equals eager from memory=None."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(attn_type="rotary"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    check_against_eager(model, lambda *a: SegmentStep(model)(*a))
    directory = txl.save_pretrained(model, tmp_path / "model")
    assert main(["export", "--checkpoint", str(directory), "--format", "torch-export",
                 "-o", str(tmp_path / "step.pt2")]) == 0
    step = load(tmp_path / "step.pt2")

    def run(ids, memory, padding):
        with torch.no_grad():
            return step(ids, memory, padding)

    check_against_eager(model, run)


def test_absolute_positions_cannot_be_exported():
    model = txl.TransformerXL(tiny_config(attn_type="absolute"))
    with pytest.raises(ValueError, match="attn_type='absolute' cannot be exported as a segment step"):
        SegmentStep(model)
