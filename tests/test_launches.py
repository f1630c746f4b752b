"""What a step asks of a GPU, held on the CPU (issue 34): no host sync inside a training or evaluation step in
the mode CUDA runs (``benchmarks.launches`` counts them), and the switches that remain
(``ComputeConfig.cluster_rows``, ``softmax_pad``, ``cast_weights``) giving the numbers they gave before. Also: the
adaptive softmax compiles with cutoffs (no ``bucketize``) and equals eager; a memory on another device is named in
one line.
"""

import os

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_model

import txl
from benchmarks import launches
from txl.model.memory import check_memory
from txl.model.positions import relative_distances, sinusoid
from txl.model.transformer import check_token_ids
from txl.train import StepStats, read_stats

pytestmark = pytest.mark.usefixtures("one_thread")

# Issue 45 removed the launch ceilings of issue 34 (a count of launched ops, copies and cats of one NVIDIA-structured
# step): a launch count alone is not a win (the GPU A/B of docs/gpu-runs/2026-11-28-h200-dac89e9: the launch cuts
# bought nothing measurable), and the kernels that cut them are gone. ``python -m benchmarks.launches`` still
# prints the counts. What stays here means something on any device: no host sync inside a step as CUDA runs it
# (CUDA graphs and torch.compile need that), and the switches that remain giving the numbers they gave before.


CUDA = txl.ComputeConfig(dropout_impl="torch", cluster_rows="all")
"""The fields whose 'auto' resolves otherwise on CUDA set as there (cluster_rows 'all'), dropout as torch's kernel."""


@pytest.mark.slow  # a 16-layer NVIDIA-structured step counted op by op (or a compile): seconds here
def test_training_step_makes_no_host_sync_as_on_cuda():
    """Forward, backward, clipping and the fused Adam step of ``txl.train.train_step``: no ``.item()``,
    ``int(tensor)``, ``nonzero`` (nor a bool-mask index, which runs one) anywhere in it."""
    with launches.as_on_cuda():
        counts = launches.train_counts(launches.narrow_nvidia(), CUDA)
    assert counts.syncs == {}, counts.syncs


def test_evaluation_segment_makes_no_host_sync_as_on_cuda():
    with launches.as_on_cuda():
        counts = launches.eval_counts(launches.narrow_nvidia(), CUDA)
    assert counts.syncs == {}, counts.syncs


@pytest.mark.slow  # a 16-layer NVIDIA-structured step counted op by op (or a compile): seconds here
def test_the_cpu_default_still_selects_cluster_rows_with_nonzero():
    """On the CPU 'auto' keeps the cheaper per-cluster selection (a sync there costs nothing); the counter sees it."""
    counts = launches.train_counts(launches.narrow_nvidia(), txl.ComputeConfig(dropout_impl="torch"))
    assert counts.syncs["aten::nonzero"] >= 3  # one per tail cluster, and the label check's bool-mask index


@pytest.mark.slow  # a 16-layer NVIDIA-structured step counted op by op (or a compile): seconds here
def test_cuda_mode_counts_dropout_as_the_one_fused_kernel_cuda_runs():
    """``as_on_cuda`` swaps F.dropout's CPU decomposition (bernoulli_, div_, mul) for ``native_dropout``, what
    ``at::dropout`` runs on a CUDA tensor: 2 fewer launches per dropout in forward, the same in backward."""
    config = launches.narrow_nvidia()
    with launches.as_on_cuda():
        fused = launches.train_counts(config, CUDA)
    with launches.as_on_cuda(dropout=False):
        cpu = launches.train_counts(config, CUDA)
    assert fused.ops["aten::native_dropout"] > 0 and fused.ops["aten::bernoulli_"] == 0
    assert cpu.launched - fused.launched == 2 * fused.ops["aten::native_dropout"], (cpu.launched, fused.launched)
    assert (cpu.copies, cpu.cats) == (fused.copies, fused.cats)


def test_the_sinusoid_halves_written_in_place_equal_their_cat():
    dist = relative_distances(37, 0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    angles = dist.float()[:, None] * inv_freq[None, :]
    assert torch.equal(sinusoid(dist, 64), torch.cat([angles.sin(), angles.cos()], dim=-1))


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
    model = tiny_model(**{"vocab_size": 120, "cutoffs": [20, 60], **changes})
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
    padded = tiny_model(softmax_pad=64).eval()
    plain = tiny_model(softmax_pad=1).eval()
    plain.load_state_dict(padded.state_dict())
    x, y = torch.randint(0, 61, (2, 5)), torch.randint(0, 61, (2, 5))
    a, b = padded(x, labels=y, return_log_probs=True), plain(x, labels=y, return_log_probs=True)
    assert a.log_probs.shape == (2, 5, 61)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.nll, b.nll, atol=1e-6, rtol=1e-6)


def test_padded_softmax_widths_are_multiples_of_the_pad():
    model = tiny_model(vocab_size=267, cutoffs=[20, 40, 200], softmax_pad=64)
    widths = [w.size(0) for w, _, _ in model.softmax._clusters(torch.float32)]
    assert widths == [64, 64, 192, 128]  # 20 + 3 cluster logits, 20, 160, 67, each up to a multiple of 64


@pytest.mark.slow  # a 16-layer NVIDIA-structured step counted op by op (or a compile): seconds here
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


def _train_and_eval_bf16(model: txl.TransformerXL, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Two training segments (memory carried) and two cached evaluation segments under bf16 autocast: losses,
    memories, every gradient and the log-probabilities."""
    torch.manual_seed(5)
    got = []
    memory = None
    for i in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.train()(x[:, 5 * i:5 * i + 5], labels=y[:, 5 * i:5 * i + 5], memory=memory)
        out.loss.backward()
        memory = out.memory
        got += [out.loss.detach(), *memory]
    got += [p.grad for p in model.parameters() if p.grad is not None]
    memory, cache = None, model.start_kv_cache()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(2):
            out = model.eval()(x[:, 5 * i:5 * i + 5], memory=memory, kv_cache=cache)
            memory, cache = out.memory, out.kv_cache
            got.append(out.log_probs)
    return got


@pytest.mark.parametrize("change", [{}, dict(pre_ln=True, untie_r=True), dict(attn_type="shaw"),
                                    dict(dropout=0.1, dropatt=0.1, dropout_impl="torch")],
                         ids=["relative", "preln-untie", "shaw", "dropout"])
def test_weights_cast_in_one_group_give_what_autocast_gives_bit_for_bit(change):
    """``cast_weights='grouped'`` (one cast of every layer weight per forward, one of their gradients back) against
    'per_use' (autocast's cast at each use): the same bf16 rounding, the same gradients, bit for bit."""
    x, y = zipf((2, 11), vocab=61), zipf((2, 11), vocab=61, seed=3)
    results = []
    for mode in ("per_use", "grouped"):
        torch.manual_seed(0)
        results.append(_train_and_eval_bf16(tiny_model(cast_weights=mode, **change), x, y))
    assert len(results[0]) == len(results[1])
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*results))


def test_grouped_casts_are_one_op_each_way_and_the_parameters_come_back():
    """One ``_foreach_copy_`` in forward and one in backward instead of a cast per weight each way; after the
    forward, and after one that raised inside a layer, the model holds its own float32 Parameters again."""
    from txl.model import casting

    model = tiny_model(cast_weights="grouped")
    before = dict(model.named_parameters())
    x = zipf((2, 5), vocab=61)
    counts = launches.count(lambda: _bf16_backward(model, x))
    assert counts.ops["aten::_foreach_copy_"] == 4, counts.ops  # the layers' and the softmax's, each way
    assert dict(model.named_parameters()).keys() == before.keys()
    assert all(p is before[n] for n, p in model.named_parameters())

    def fail(module, args):
        assert module.attn.qkv.weight.dtype == torch.bfloat16  # inside the forward, the layer reads the cast
        raise RuntimeError("inside a layer")

    handle = model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inside a layer"):
        _bf16_backward(model, x)
    handle.remove()
    assert all(p is before[n] and type(p) is torch.nn.Parameter for n, p in model.named_parameters())
    per_use = launches.count(lambda: _bf16_backward(tiny_model(cast_weights="per_use"), x))
    assert per_use.copies - counts.copies >= 2 * len(casting.matmul_weights(model.layers)) - 2, (per_use.copies,
                                                                                               counts.copies)


def _bf16_backward(model: txl.TransformerXL, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.train()(x, labels=x)
    out.loss.backward()


def test_auto_groups_plain_float32_parameters_under_autocast_only():
    from txl.model import casting

    class Sharded(torch.nn.Parameter):  # stands for FSDP's DTensor parameters: not a plain tensor
        pass

    plain = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    assert casting.groupable(plain, torch.bfloat16)
    assert not casting.groupable(plain, torch.float32)  # no autocast: nothing to cast
    assert not casting.groupable([*plain, Sharded(torch.zeros(2))], torch.bfloat16)
    assert not casting.groupable([], torch.bfloat16)
    x = zipf((2, 5), vocab=61)
    fp32 = [launches.count(lambda m=mode: tiny_model(cast_weights=m)(x, labels=x).loss.backward())
            for mode in ("auto", "per_use")]  # without autocast 'auto' casts nothing: the same ops
    assert fp32[0].ops["aten::_foreach_copy_"] == 0 and fp32[0].ops == fp32[1].ops


def _softmax_bf16(model: txl.TransformerXL, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Per-token NLL and every gradient of one bf16 training segment, then bf16 log-probabilities."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.train()(x, labels=y)
    out.loss.backward()
    got = [out.nll.detach()] + [p.grad for p in model.parameters() if p.grad is not None]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got.append(model.eval()(x).log_probs)
    return got


@pytest.mark.parametrize("change", [{}, dict(div_val=2), dict(d_embed=16),
                                    dict(div_val=2, cluster_rows="all", tie_weight=False), dict(softmax_pad=7),
                                    dict(softmax_pad=64, cluster_rows="all", d_embed=16), dict(cutoffs=[])],
                         ids=["selected", "div2", "projected", "div2-all-untied", "pad-7", "pad-64-all-projected",
                              "no-cutoffs"])
def test_the_softmax_weights_cast_in_one_group_give_the_per_use_numbers_bit_for_bit(change):
    """``casting.cast_rows`` (the softmax's weights, biases, cluster rows and projections cast and laid out, the head's
    cluster rows and the padding included, by one op; their gradients back by one) against a cast of each: the
    same NLL, gradients (an unseen cluster's too: no token of the batch is in the last one) and log-probabilities.
    (With 'all' rows, div_val 1 and no projections the clusters share one matmul: next test.)"""
    x, y = zipf((3, 7), seed=1), zipf((3, 7), seed=2).clamp(max=59)  # ids >= 60: the last cluster, unseen
    y[0, :2] = torch.tensor([30, 50])
    y[1, 3] = -100
    got = [_softmax_bf16(word_model(cast_weights=mode, **change), x, y) for mode in ("per_use", "grouped")]
    assert len(got[0]) == len(got[1])
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*got)), [
        i for i, (a, b) in enumerate(zip(*got)) if not torch.equal(a, b)]


def test_the_softmax_casts_are_one_op_each_way():
    """Under bf16 autocast with cutoffs (div_val 1, the tied table): 8 copies and 4 cats fewer than a cast of each
    parameter (the table, its bias, the cluster rows and their bias, each way; the head's two cats and the split's
    two in backward), for one ``_foreach_copy_`` each way."""
    y = zipf((3, 7), seed=2)
    counts = {}
    for mode in ("per_use", "grouped"):
        softmax = word_model(cast_weights=mode).softmax
        hidden = torch.randn(21, 32, requires_grad=True)

        def step(softmax=softmax, hidden=hidden):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                nll = softmax.nll(hidden, y.reshape(-1))
            nll.sum().backward()

        counts[mode] = launches.count(step)
    per_use, grouped = counts["per_use"], counts["grouped"]
    assert grouped.ops["aten::_foreach_copy_"] == 2 and per_use.ops["aten::_foreach_copy_"] == 0
    assert (per_use.copies - grouped.copies, per_use.cats - grouped.cats) == (8, 4), (per_use.ops, grouped.ops)


def test_an_unclipped_step_only_measures_the_gradient_norm():
    """clip 0 (max_norm inf): the norm torch's clip_grad_norm_ returns, the gradients untouched, and 3 launches where
    torch's scaling of every gradient by min(1, inf / norm) = 1 added 5."""
    import math

    from txl import parallel

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in params]
    with launches._Dispatched() as mode:
        norm = parallel.clip_grad_norm(params, math.inf)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, b in zip(copies, before):
        c.grad = b.clone()
    with launches._Dispatched() as clipped:
        expected = torch.nn.utils.clip_grad_norm_(copies, math.inf)
    assert torch.equal(norm, expected) and all(torch.equal(c.grad, b) for c, b in zip(copies, before))
    assert mode.launched == 3 and clipped.launched > mode.launched, (mode.ops, clipped.ops)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("change", [dict(cluster_rows="selected"), dict(cluster_rows="all"),
                                    dict(cluster_rows="all", div_val=2, softmax_pad=8), dict(cutoffs=[])],
                         ids=["selected", "all-rows", "all-div2-pad", "no-cutoffs"])
def test_nll_is_minus_the_log_prob_of_the_target_bit_for_bit(change, precision):
    """``nll`` (the head's term by F.nll_loss, a tail's subtracted: -h - t) against ``log_prob`` (h + t, the full
    distribution), read at the target: equal bit for bit, and 0 at an ignored target.

    Except a tail token's under 'selected' rows: there ``nll`` scores a tail cluster over its own tokens' rows
    (``hidden[idx]``, N_i rows) where ``log_prob`` scores all N rows, and a float32 matmul's rounding of one row may
    depend on how many rows it is given: equal on AVX-512 CPUs, apart on an AVX2-only CPU (issue 44; under
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU, target 87, the only token of its cluster:
    4.8e-7 on 7.7, 1 ulp). Those tokens are compared within 4 float32 ulps; the head's
    tokens (one matmul of all rows on both sides) and every token under 'all' rows and without cutoffs stay
    bit for bit on every CPU."""
    softmax = word_model(**change).softmax
    hidden = torch.randn(21, 32, generator=torch.Generator().manual_seed(4))
    target = zipf((3, 7), seed=2).reshape(-1)
    target[[2, 9]] = torch.tensor([119, 45])  # both tail clusters are met
    target[[0, 5]] = -100
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        nll = softmax.nll(hidden, target)
        log_prob = softmax.log_prob(hidden)
    expected = -log_prob.gather(1, target.clamp(min=0)[:, None]).squeeze(1)  # (N,)
    kept = target != -100
    rounded = kept & (target >= 20) if change.get("cluster_rows") == "selected" else torch.zeros_like(kept)
    exact = kept & ~rounded
    assert exact.sum() >= 9 and torch.equal(nll[exact], expected[exact])  # 9 head tokens under 'selected'
    torch.testing.assert_close(nll[rounded], expected[rounded], rtol=4 * 2 ** -23, atol=0)
    assert torch.equal(nll[~kept], torch.zeros(2))



def test_cast_rows_lays_out_blocks_and_pads_and_casts_gradients_back():
    """``casting.cast_rows``: each output the listed row blocks in the compute dtype (pads filled with its value); in
    backward each parameter's gradient gathered from its blocks', in float32, zeros for rows of a used parameter
    no used output covers, None for a parameter no used output reads: what casts, cats and slices give."""
    from txl.model import casting

    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(n, 3, generator=gen)) for n in (5, 2, 4))
    layouts = [[(0, 0, 2), (1, 0, 2), 3], [(0, 3, 5)], [(2, 0, 4)]]  # rows 2 of a in no output; c's output unused
    outs = casting.cast_rows([a, b, c], layouts, [0.0, 0.0, float("-inf")], torch.bfloat16)
    want = [torch.cat([a[:2], b, torch.zeros(3, 3)]).bfloat16(), a[3:].bfloat16(), c.bfloat16()]
    assert all(o.dtype == torch.bfloat16 and torch.equal(o, w) for o, w in zip(outs, want))
    g0, g1 = torch.randn(7, 3, generator=gen).bfloat16(), torch.randn(2, 3, generator=gen).bfloat16()
    torch.autograd.backward([outs[0], outs[1]], [g0, g1])
    assert torch.equal(a.grad, torch.cat([g0[:2], torch.zeros(1, 3).bfloat16(), g1]).float())
    assert torch.equal(b.grad, g0[2:4].float()) and c.grad is None


