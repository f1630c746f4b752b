"""What a step asks of a GPU, held on the CPU (issue 34): no host sync inside a training or evaluation step in
the mode CUDA runs, ceilings on the launched ops, copies and cats of one NVIDIA-structured bf16 training step
(``benchmarks.launches``), and the switches behind them (``ModelConfig.cluster_rows``, ``softmax_pad``,
``state_dtype``) giving the numbers they gave before. Also: the adaptive softmax compiles with cutoffs (no
``bucketize``) and equals eager; a memory on another device is named in one line.
"""

import os

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
from benchmarks import launches
from txl.model.memory import check_memory
from txl.model.transformer import check_token_ids
from txl.train import StepStats, read_stats

pytestmark = pytest.mark.usefixtures("one_thread")

# One train step of ``launches.narrow_nvidia()`` (16 layers, 3 tail clusters, bf16 autocast, dropout 0.1) as a GPU
# runs it (``as_on_cuda``, dropout_impl 'torch', cluster_rows 'all'), counted by ``launches.count``:
#
#                         launched   copies   cat   syncs (_local_scalar_dense + nonzero)
#   a4a52e2 (before)          2166      756    51      12  (8 + 4)
#   issue 34 (now)            1882      509    37       0
#   issue 34's target        <=1083    <=252  <=25      0
#
# The targets (1/2 of the launches, 1/3 of the copies, 1/2 of the cats) are not reached: most of what remains is
# autocast's casts of float32 weights and of the float32 residual stream (one per weight and per layer input in
# forward, and their gradients' casts back in backward: 155 of the 509 copies are ToCopyBackward), which only a
# bf16 copy of the weights kept across steps or a bf16 residual stream would remove. The ceilings hold what was
# reached, with 3% of room for a torch release's decompositions.
CEILINGS = {"launched": 1940, "copies": 525, "cat": 38}


def cuda_mode() -> txl.ModelConfig:
    return launches.narrow_nvidia(dropout_impl="torch", cluster_rows="all")


def test_training_step_makes_no_host_sync_as_on_cuda():
    """Forward, backward, clipping and the fused Adam step of ``txl.train.train_step``: no ``.item()``,
    ``int(tensor)``, ``nonzero`` (nor a bool-mask index, which runs one) anywhere in it."""
    with launches.as_on_cuda():
        counts = launches.train_counts(cuda_mode())
    assert counts.syncs == {}, counts.syncs


def test_evaluation_segment_makes_no_host_sync_as_on_cuda():
    with launches.as_on_cuda():
        counts = launches.eval_counts(cuda_mode())
    assert counts.syncs == {}, counts.syncs


def test_the_cpu_default_still_selects_cluster_rows_with_nonzero():
    """On the CPU 'auto' keeps the cheaper per-cluster selection (a sync there costs nothing); the counter sees it."""
    counts = launches.train_counts(launches.narrow_nvidia(dropout_impl="torch"))
    assert counts.syncs["aten::nonzero"] >= 3  # one per tail cluster, and the label check's bool-mask index


def test_one_nvidia_structured_bf16_step_stays_under_the_launch_ceilings():
    with launches.as_on_cuda():
        row = launches.train_counts(cuda_mode()).row()
    assert {k: row[k] for k in CEILINGS} == {k: min(row[k], CEILINGS[k]) for k in CEILINGS}, row


def test_read_stats_reads_device_figures_once_and_keeps_python_numbers():
    steps = [StepStats(torch.tensor(2.5, dtype=torch.float64), torch.tensor(12), 0.1, torch.tensor(0.75)),
             StepStats(float("nan"), 3, 0.2, 1.5)]  # figures already read, as a test double would give them
    read = read_stats(steps)
    assert [(s.loss, s.tokens, s.lr, s.grad_norm) for s in read[:1]] == [(2.5, 12, 0.1, 0.75)]
    assert np.isnan(read[1].loss) and (read[1].tokens, read[1].grad_norm) == (3, 1.5)
    assert all(type(v) in (float, int) for s in read for v in (s.loss, s.tokens, s.grad_norm))


def word_model(**changes) -> txl.TransformerXL:
    """Three clusters (shortlist 20, tails 40 and 60), weights perturbed so that every bias counts."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(vocab_size=120, cutoffs=[20, 60], **changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def zipf(shape: tuple[int, ...], vocab: int = 120, seed: int = 0) -> torch.Tensor:
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, shape[0] * shape[1], replacement=True, generator=gen).view(shape)


def loss_and_grads(model: txl.TransformerXL, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    out = model(x, labels=y)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        log_probs = model.eval()(x).log_probs
    model.train()
    return out.nll.detach(), log_probs, grads


@pytest.mark.parametrize("div_val", [1, 4])
@pytest.mark.parametrize("change", [dict(cluster_rows="all"), dict(softmax_pad=64), dict(softmax_pad=7)],
                         ids=["all-rows", "pad-64", "pad-7"])
def test_static_cluster_rows_and_padded_widths_give_the_same_numbers(div_val, change):
    """Every tail cluster on every row (masked), or the softmax widths padded with -inf columns: per-token NLL,
    the full log-probabilities and every gradient as the per-cluster selection of unpadded widths gives them
    (an unused cluster's gradient is zero there, absent here)."""
    x, y = zipf((3, 7), seed=1), zipf((3, 7), seed=2)
    y[0, :2] = torch.tensor([30, 119])  # both tail clusters are met
    y[1, 3] = -100
    base = loss_and_grads(word_model(div_val=div_val, cluster_rows="selected", softmax_pad=1).train(), x, y)
    other = loss_and_grads(word_model(div_val=div_val, **change).train(), x, y)
    torch.testing.assert_close(other[0], base[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(other[1], base[1], atol=1e-6, rtol=1e-6)
    for name, grad in other[2].items():
        torch.testing.assert_close(grad, base[2].get(name, torch.zeros_like(grad)), atol=1e-6, rtol=1e-6)


def test_a_padded_plain_softmax_gives_the_same_log_probs_and_nll():
    """No cutoffs: one matmul 61 wide, padded to 64 with -inf columns that the log-probabilities leave out."""
    torch.manual_seed(0)
    padded = txl.TransformerXL(tiny_config(softmax_pad=64)).eval()
    plain = txl.TransformerXL(tiny_config(softmax_pad=1)).eval()
    plain.load_state_dict(padded.state_dict())
    x, y = torch.randint(0, 61, (2, 5)), torch.randint(0, 61, (2, 5))
    a, b = padded(x, labels=y, return_log_probs=True), plain(x, labels=y, return_log_probs=True)
    assert a.log_probs.shape == (2, 5, 61)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.nll, b.nll, atol=1e-6, rtol=1e-6)


def test_padded_softmax_widths_are_multiples_of_the_pad():
    model = txl.TransformerXL(tiny_config(vocab_size=267, cutoffs=[20, 40, 200], softmax_pad=64))
    widths = [w.size(0) for w, _, _ in model.softmax._clusters(torch.float32, torch.device("cpu"))]
    assert widths == [64, 64, 192, 128]  # 20 + 3 cluster logits, 20, 160, 67, each up to a multiple of 64


def test_float32_is_unchanged_by_the_state_dtype():
    """Without autocast both state dtypes are the weights' dtype: the same loss, memory and gradients, bit for bit."""
    x, y = zipf((2, 9)), zipf((2, 9), seed=3)
    results = []
    for state in ("compute", "residual"):
        model = word_model(state_dtype=state).train()
        torch.manual_seed(5)
        first = model(x, labels=y)
        out = model(x, labels=y, memory=first.memory)
        out.loss.backward()
        results.append((out.loss, out.memory, [p.grad for p in model.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2], strict=True))


def test_bf16_autocast_keeps_the_memory_in_the_compute_dtype_and_close_to_before():
    x, y = zipf((2, 9)), zipf((2, 9), seed=3)
    losses = {}
    for state in ("compute", "residual"):
        model = word_model(state_dtype=state).eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            first = model(x, labels=y)
            out = model(x, labels=y, memory=first.memory)
        assert {m.dtype for m in out.memory} == {torch.bfloat16 if state == "compute" else torch.float32}
        losses[state] = out.loss.item()
    assert abs(losses["compute"] - losses["residual"]) < 2e-2, losses


def test_adaptive_softmax_graph_has_no_bucketize_and_compiles_at_two_shapes():
    """Dynamic shapes through the compiler (aot_eager keeps it fast on a CPU): the graph the compiler traces has
    no bucketize (the Triton failure on a GPU), and both shapes equal eager."""
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    model = word_model().train()
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    for shape, seed in (((2, 6), 1), ((3, 9), 2)):
        x, y = zipf(shape, seed=seed), zipf(shape, seed=seed + 10)
        y[0, 0] = 119
        torch.testing.assert_close(compiled(x, labels=y).nll, model(x, labels=y).nll, atol=1e-5, rtol=1e-5)
    assert ops and not any("bucketize" in op for op in ops)


@pytest.mark.skipif(os.environ.get("TXL_SLOW_TESTS") != "1", reason="an inductor compile takes ~60 s on 2 cores; "
                                                                   "run with TXL_SLOW_TESTS=1")
def test_inductor_compiles_the_adaptive_softmax_with_cutoffs_at_every_shape():
    model = word_model().train()
    compiled = torch.compile(model.softmax.nll, dynamic=True)
    for n, seed in ((12, 1), (7, 2)):
        gen = torch.Generator().manual_seed(seed)
        h, t = torch.randn(n, 32, generator=gen), zipf((1, n), seed=seed).view(-1)
        torch.testing.assert_close(compiled(h, t), model.softmax.nll(h, t), atol=1e-5, rtol=1e-5)


def test_memory_on_another_device_is_named_in_one_line():
    memory = tuple(torch.zeros(2, 3, 32, device="meta") for _ in range(2))
    with pytest.raises(ValueError, match=r"^memory\[0\] is on meta but the model is on cpu: move the memory with "):
        check_memory(memory, n_layer=2, batch_size=2, d_model=32, device=torch.device("cpu"))
    model = txl.TransformerXL(tiny_config())
    with pytest.raises(ValueError, match=r"memory\[0\] is on meta but the model is on cpu"):
        model(torch.zeros(2, 4, dtype=torch.long), memory=memory)


def test_token_ids_are_checked_on_the_host():
    check_token_ids(np.array([0, 5, 60]), 61)
    with pytest.raises(ValueError, match="token id 61 is out of range for vocab_size=61"):
        check_token_ids(np.array([0, 61]), 61)
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        check_token_ids(torch.tensor([[-1, 2]]), 61)
