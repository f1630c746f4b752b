"""Export of one segment step: the exported program's log-probabilities and memories equal the eager
model's over three segments of different lengths, at another batch size than the one traced; for a compressive
model both memories, over segments that compress nothing, some groups and more than its slots hold."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
import txl.export
from txl.cli import main
from txl.export import SegmentStep, initial_state, load, segment_step
from txl.model.attention import attn_types

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


@pytest.mark.slow  # torch.export (53 s loaded)
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


@pytest.mark.slow  # an ONNX export (109 s loaded)
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


@pytest.mark.slow  # an ONNX export (84 s loaded)
def test_onnx_of_a_large_model_names_its_weights_file(model_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import txl.export

    monkeypatch.setattr(txl.export, "ONNX_INLINE_LIMIT", 0)  # as if the weights were over 1 GiB
    assert main(["export", "--checkpoint", str(model_dir), "--format", "onnx", "-o", str(tmp_path / "s.onnx")]) == 0
    assert (tmp_path / "s.onnx.data").is_file()
    assert f"{tmp_path / 's.onnx.data'}: the weights (over 1 GiB, too large to keep inside s.onnx); ship it beside " \
        "s.onnx" in capsys.readouterr().out


@pytest.mark.slow  # torch.export (40 s loaded)
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


# -- a compressive model (cmem_len > 0): both memories in and out, the eviction in its static form --------------

COMPRESSIVE_SEGMENTS = (4, 1, 1, 2, 7, 3, 1)
"""Memory 4, 3 slots at rate 2: nothing compressed, then one slot, two, then 3 groups at once (the oldest dropped)."""


def compressive_model(attn_type: str = "relative") -> txl.TransformerXL:
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(attn_type=attn_type, mem_len=4, cmem_len=3, cmem_rate=2, cmem_fn="conv"))
    with torch.no_grad():  # the conv too: not the mean pooling it starts as
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def assert_state_equals_eager(state, eager, model) -> None:
    """The exported state (memory, padding, compressed, padding) holds the eager memories as its last rows, pads
    (zeros) before them."""
    L = model.config.n_layer
    for buf, pad, rows in ((state[0], state[1], eager[:L]), (state[2], state[3], eager[L:])):
        n, B = rows[0].size(1), rows[0].size(0)
        size = buf.size(2)
        assert pad.tolist() == [[True] * (size - n) + [False] * n] * B
        for layer in range(L):
            torch.testing.assert_close(buf[layer][:, size - n:], rows[layer], atol=2e-6, rtol=1e-5)
            assert not buf[layer][:, :size - n].any()


def check_compressive_against_eager(model, step) -> None:
    """Seven segments of different lengths through ``step`` from initial_state vs eager from memory=None; then
    rows at different points of their streams (different counts of real rows and slots) stepped as one batch
    against each row eager alone."""
    B = 3
    state = initial_state(model, B)
    assert [tuple(t.shape) for t in state] == [(2, B, 5, 32), (B, 5), (2, B, 3, 32), (B, 3)]
    eager = None
    torch.manual_seed(1)
    seen = []
    for T in COMPRESSIVE_SEGMENTS:
        ids = torch.randint(0, model.config.vocab_size, (B, T))
        log_probs, *state = step(ids, *state)
        with torch.no_grad():
            out = model(ids, memory=eager, return_log_probs=True)
        eager = out.memory
        torch.testing.assert_close(log_probs, out.log_probs, atol=2e-6, rtol=1e-5)
        assert_state_equals_eager(state, eager, model)
        seen.append((eager[0].size(1), eager[2].size(1)))
    assert seen == [(4, 0), (5, 0), (4, 1), (4, 2), (5, 3), (4, 3), (5, 3)]  # (memory rows, slots) after each
    # Row b of a batch read 2 + b segments: (5, 0), (4, 1) and (4, 2) rows and slots, stepped together.
    rows, alone = [], []
    for b in range(3):
        s, e = initial_state(model, 1), None
        for T in COMPRESSIVE_SEGMENTS[:2 + b]:
            ids = torch.randint(0, model.config.vocab_size, (1, T))
            _, *s = step(ids, *s)
            with torch.no_grad():
                e = model(ids, memory=e).memory
        rows.append(s)
        alone.append(e)
    batch = [torch.cat([r[i] for r in rows], dim=1 if i in (0, 2) else 0) for i in range(4)]
    ids = torch.randint(0, model.config.vocab_size, (3, 3))
    log_probs, *state = step(ids, *batch)
    for b in range(3):
        with torch.no_grad():
            out = model(ids[b:b + 1], memory=alone[b], return_log_probs=True)
        torch.testing.assert_close(log_probs[b:b + 1], out.log_probs, atol=2e-6, rtol=1e-5)
        assert_state_equals_eager([state[0][:, b:b + 1], state[1][b:b + 1], state[2][:, b:b + 1], state[3][b:b + 1]],
                                  out.memory, model)


@pytest.mark.parametrize("attn_type", attn_types(relative=True))
def test_the_compressive_segment_step_equals_the_eager_model(attn_type):
    """The module that is exported, run eagerly: the static eviction computes the model's."""
    model = compressive_model(attn_type)
    check_compressive_against_eager(model, lambda *a: segment_step(model)(*a))


@pytest.mark.slow  # torch.export (41 s loaded)
def test_torch_export_of_a_compressive_model_equals_eager(tmp_path, capsys):
    model = compressive_model()
    directory = txl.save_pretrained(model, tmp_path / "model")
    assert main(["export", "--checkpoint", str(directory), "--format", "torch-export",
                 "-o", str(tmp_path / "step.pt2")]) == 0
    assert ("memory 5 rows and 3 compressed slots at rate 2; inputs input_ids (B, T) int64, memory (2, B, 5, 32) "
            "float32, memory_padding (B, 5) bool, compressed (2, B, 3, 32) float32, compressed_padding (B, 3) bool; "
            "outputs log_probs (B, T, 61), new_memory, new_padding, new_compressed, new_compressed_padding"
            ) in capsys.readouterr().out
    step = load(tmp_path / "step.pt2")

    def run(*args):
        with torch.no_grad():
            return step(*args)

    check_compressive_against_eager(txl.from_pretrained(directory), run)


@pytest.mark.slow  # an ONNX export (65 s loaded)
def test_onnx_of_a_compressive_model_equals_eager(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = compressive_model()
    session = ort.InferenceSession(str(txl.export.export(model, tmp_path / "s.onnx", format="onnx")))
    names = [i.name for i in session.get_inputs()]
    assert names == ["input_ids", "memory", "memory_padding", "compressed", "compressed_padding"]

    def run(*args):
        outs = session.run(None, {n: np.asarray(a) for n, a in zip(names, args)})
        return tuple(torch.from_numpy(o) for o in outs)

    check_compressive_against_eager(model, run)
