"""txl.static_eval: evaluation over per-layer key/value rings written in place equals the model's own evaluation (the
memory and key/value cache carried), a ring rotated by any offset equals the keys in order, and the compiled segment
keeps the capture's discipline on a CPU: one graph and no recompilation over 20 segments, the buffers' addresses
fixed, no host sync inside a segment. Compiled tests use aot_eager or the counting backend (no code generation)."""

import logging

import pytest
import torch
from conftest import Counting, HostSyncs, tiny_config

import txl
from txl.evaluate import evaluate, inference_context
from txl.model import plain
from txl.model.plan import resolve
from txl.model.positions import Positions, attention_mask
from txl.static_eval import StaticEval, ring_mask, ring_segment, static_eval_error

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(atol=2e-6, rtol=2e-6)
"""Per-token NLL against the model's evaluation, float32: the ring reads the same keys and positions, but SDPA sums
over R = mem_len + T columns in ring order where the model sums over M + T in stream order (a handful of ulps)."""
B, T = 3, 4


def segments(n: int, last: int = T, seed: int = 1):
    """n segments of T tokens of B streams, the last one ``last`` tokens long: (ids, labels) pairs."""
    tokens = torch.randint(0, 61, (B, T * n + 1), generator=torch.Generator().manual_seed(seed))
    lengths = [T] * (n - 1) + [last]
    out, at = [], 0
    for length in lengths:
        out.append((tokens[:, at:at + length], tokens[:, at + 1:at + length + 1]))
        at += length
    return out


def model_evaluation(model, batches, ctx):
    """The model's evaluation (``txl.evaluate``'s loop): per-segment NLL, memory and key/value cache carried."""
    memory, cache, nlls = None, model.start_kv_cache(), []
    for x, y in batches:
        out = model(x, labels=y, memory=memory, kv_cache=cache, context=ctx)
        memory, cache = out.memory, out.kv_cache
        nlls.append(out.nll)
    return nlls


CASES = [
    ({}, {}),  # mem_len 7, T 4: the ring of 11 columns wraps inside a segment
    (dict(mem_len=8, cutoffs=[20, 40]), dict(same_length=True)),  # R = 12, a multiple of T; adaptive softmax
    (dict(pre_ln=True, untie_r=True), dict(clamp_len=3, mem_len=5)),  # the distances clamped
    ({}, dict(same_length=True, same_length_style="tensorflow", mem_len=9)),  # eval's mem_len above training's
    ({}, dict(mem_len=0)),  # no memory: the ring holds the segment alone
]


@pytest.mark.parametrize(("model_changes", "context_changes"), CASES)
def test_ring_evaluation_equals_the_models_over_many_segments(model_changes, context_changes):
    """13 segments (the memory fills over the first two, then the ring wraps round many times) and a last one of 2
    tokens (run uncompiled on the same rings): every per-token NLL and the summed loss equal the model's."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(**{"mem_len": 7, **model_changes}))
    batches = segments(14, last=2)
    with inference_context(model, **context_changes) as ctx:
        want = model_evaluation(model, batches, ctx)
        ring = StaticEval(model, ctx, compile=False)
        got = [ring(x, y).clone() for x, y in batches]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    total, tokens = ring.sums().tolist()
    assert tokens == B * (13 * T + 2)
    assert total == pytest.approx(sum(float(w.double().sum()) for w in want), rel=1e-6)


@pytest.mark.parametrize("context_changes", [{}, dict(same_length=True), dict(clamp_len=5),
                                             dict(same_length=True, same_length_style="tensorflow")])
@pytest.mark.parametrize("filled", [0, 3, 7])
def test_a_ring_rotated_by_every_offset_equals_the_keys_in_order(context_changes, filled):
    """One layer over keys in stream order (``rel_shift``'s alignment, the model's mask) and over the same keys laid
    in a ring of R = S + T columns starting at every offset (the positional scores gathered by distance, the ring's
    mask): the same outputs, and the ring's mask is the ordered one, column for column."""
    torch.manual_seed(0)
    S = 7
    model = txl.TransformerXL(tiny_config(mem_len=S)).eval()
    ctx = model.config.context(**context_changes)
    layer, attns = model.layers[0], [layer.attn for layer in model.layers]
    R, K = S + T, filled + T
    x, memory = torch.randn(B, T, 32), torch.randn(B, filled, 32)
    with torch.no_grad():
        k, val = layer.attn.keys_values(torch.cat([memory, x], dim=1))  # (B, K, H, D) in stream order
        table = model.encoding.grow_table(attns, (), R, ctx.clamp_len, d_model=32, dtype=torch.float32,
                                          device=x.device)
        N = table[0].size(0)
        pos = plain.layer_positions(model, K, ctx.clamp_len, torch.float32, model.drop, table)[0]
        mask = attention_mask(T, filled, mem_len=S, same_length=ctx.same_length, style=ctx.same_length_style)
        want = layer(x, None, mask, pos, model.u, model.v, kv=(k, val))
        horizon = S + (ctx.same_length_style == "tensorflow") if ctx.same_length else 0
        for offset in range(R):
            columns = (offset - filled + torch.arange(K)) % R  # where each key in stream order lies
            ring_k = torch.randn(B, R, 4, 8).index_copy_(1, columns, k)  # the other columns: stale rows
            ring_v = torch.randn(B, R, 4, 8).index_copy_(1, columns, val)
            w, dist, hidden = ring_mask(torch.tensor([offset]), torch.tensor([filled]), T, R, horizon)
            assert w.tolist() == columns[filled:].tolist()
            assert torch.equal(hidden[:, columns], mask)  # visible: exactly the ordered mask's keys
            assert hidden.sum() == T * R - (~mask).sum()  # every column not in the window is hidden
            rows = N - 1 - dist.clamp(max=N - 1)
            got = layer(x, None, hidden, Positions(projected=table[0], index=rows), model.u, model.v,
                        kv=(ring_k, ring_v))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"offset {offset}")


def test_the_compiled_segment_is_one_graph_on_fixed_buffers_and_reads_nothing_back(monkeypatch):
    """CUDA's resolved model (cluster_rows 'all', as CUDA captures it) through the counting backend over 20 segments
    and a shorter last one: one graph, no recompilation, every buffer at the same address, no op inside a segment
    that waits on the device, and the per-token NLL equal to the model's. The counter does count: the plain CPU
    model ('selected' rows: nonzero) syncs."""
    from txl.model import transformer

    monkeypatch.setattr(transformer, "reads_values", lambda t: False)  # as on CUDA: no value checks
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(mem_len=7, cutoffs=[20, 40]), resolve(txl.ComputeConfig(), "cuda"))
    batches = segments(21, last=3)
    counter = Counting()
    with inference_context(model) as ctx:
        want = model_evaluation(model, batches, ctx)
        ring = StaticEval(model, ctx, backend=counter)
        compiled, reads, got, pointers = ring.fn, HostSyncs(), [], None

        def counted(*args, **kwargs):
            with reads:
                compiled(*args, **kwargs)

        with torch._dynamo.config.patch(error_on_recompile=True):
            for s, (x, y) in enumerate(batches):
                if s == 1:  # the first allocated and compiled: the rest under the counter
                    monkeypatch.setattr(ring, "fn", counted)
                got.append(ring(x, y).clone())
                now = [t.data_ptr() for t in (*ring.buffers.values(), *ring.keys, *ring.values, *ring.table)]
                assert pointers is None or now == pointers
                pointers = now
    # One graph, made by the first segment; under a dispatch mode dynamo runs the frame's own ops (what the
    # counter judges), not the graph.
    assert counter.graphs == 1 and counter.runs == 1
    assert reads.seen == []
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)

    plain = txl.TransformerXL(tiny_config(mem_len=7, cutoffs=[20, 40]))  # the CPU's own path: 'selected' rows
    with inference_context(plain) as ctx, HostSyncs() as control:
        StaticEval(plain, ctx, compile=False)(*batches[0])
    assert "aten::nonzero" in control.seen


def test_the_compiled_segment_runs_20_segments_as_one_graph():
    """Without a dispatch mode in the way: the counting backend (aot_eager) makes one graph and runs it for every full
    segment, equal to the model's evaluation; the shorter last one runs uncompiled (no second graph)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(mem_len=7))
    counter = Counting()
    batches = segments(21, last=3)
    with inference_context(model) as ctx, torch._dynamo.config.patch(error_on_recompile=True):
        want = model_evaluation(model, batches, ctx)
        ring = StaticEval(model, ctx, backend=counter)
        got = [ring(x, y).clone() for x, y in batches]
    assert counter.graphs == 1 and counter.runs == 20
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_evaluate_with_graphs_reads_rings_and_equals_evaluate_without(monkeypatch, caplog):
    """``txl.evaluate(graphs=True)`` (``txl eval --graphs``) through the rings (aot_eager here) gives the loss and token
    count of the plain evaluation, a last shorter segment included; an encoding the rings cannot read (Shaw's) goes
    through ``txl.graphs.StaticSteps`` with one line saying why."""
    import numpy as np

    from txl import graphs, static_eval

    made = []

    def aot_eager(backend=None):
        made.append(backend)
        return torch.compile(ring_segment, backend="aot_eager", dynamic=False)

    monkeypatch.setattr(static_eval, "compile_segment", aot_eager)
    monkeypatch.setattr(graphs, "compile_static", lambda model, backend=None: model)  # StaticSteps, uncompiled
    tokens = np.random.default_rng(0).integers(0, 61, size=2 * 4 * 9 + 7)  # 39 a stream: 9 segments of 4, one of 2
    for attn_type in ("relative", "shaw"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = txl.TransformerXL(tiny_config(mem_len=6, attn_type=attn_type))
        kwargs = dict(metric="ppl", batch_size=2, tgt_len=4)
        plain = evaluate(model, tokens, **kwargs)
        with caplog.at_level(logging.INFO, logger="txl.evaluate"):
            caplog.clear()
            graphed = evaluate(model, tokens, graphs=True, **kwargs)
        assert graphed.tokens == plain.tokens == 2 * (4 * 9 + 2)
        assert graphed.loss == pytest.approx(plain.loss, rel=1e-6)
        lines = [r.getMessage() for r in caplog.records if r.name == "txl.evaluate"]
        if attn_type == "relative":
            assert lines == [] and len(made) == 1
        else:
            assert lines == ["eval graphs: through txl.graphs.StaticSteps (the memory copied in and out), not rings: "
                             "attn_type='shaw': the ring reads the paper's relative positional table by distance; "
                             "other encodings place keys by their index in the window"]


def test_txl_score_with_graphs_equals_without(tmp_path, monkeypatch, capsys):
    """``txl score --graphs`` (through aot_eager here) reaches the rings and writes the totals ``txl score`` writes."""
    import json

    from test_generate_cli import _byte_checkpoint, run_cli

    from txl import static_eval

    made = []

    def aot_eager(backend=None):
        made.append(backend)
        return torch.compile(ring_segment, backend="aot_eager", dynamic=False)

    monkeypatch.setattr(static_eval, "compile_segment", aot_eager)
    torch._dynamo.reset()
    ckpt, text = _byte_checkpoint(tmp_path)
    totals = []
    for extra in ([], ["--graphs"]):
        rc, out, err = run_cli(capsys, "score", "--checkpoint", ckpt, "--segment-len", 4, "--mem-len", 6,
                               "--totals-only", "-o", "-", *extra, text)
        assert rc == 0, err
        totals.append(json.loads(out))
    assert len(made) == 1
    assert totals[1]["tokens"] == totals[0]["tokens"] > 0
    assert totals[1]["nll"] == pytest.approx(totals[0]["nll"], rel=1e-6)


@pytest.mark.parametrize(("model_changes", "context_changes", "why"), [
    (dict(attn_type="rotary"), {}, "attn_type='rotary': the ring reads the paper's relative positional table"),
    (dict(cmem_len=4, cmem_rate=2), {}, "cmem_len=4: a compressed memory is rebuilt"),
    ({}, dict(ext_len=2), "ext_len=2 re-feeds rows each segment"),
])
def test_what_the_rings_cannot_take_says_why(model_changes, context_changes, why):
    model = txl.TransformerXL(tiny_config(**model_changes))
    ctx = model.config.context(**context_changes)
    assert why in static_eval_error(model, ctx)
    with pytest.raises(ValueError, match="StaticEval: .*evaluate through txl.graphs.StaticSteps"):
        StaticEval(model, ctx)


def test_a_segment_of_another_shape_is_refused_with_what_to_do():
    model = txl.TransformerXL(tiny_config())
    with inference_context(model) as ctx:
        ring = StaticEval(model, ctx, compile=False)
        x = torch.zeros(B, T, dtype=torch.long)
        ring(x, x)
        with pytest.raises(ValueError, match=r"built for segments of \(3, 4\) tokens and got \(2, 4\): a shorter "):
            ring(x[:2], x[:2])
        with pytest.raises(ValueError, match=r"got \(3, 5\)"):
            ring(torch.zeros(B, T + 1, dtype=torch.long), torch.zeros(B, T + 1, dtype=torch.long))


def test_reset_starts_the_streams_again():
    """After ``reset`` the rings' old columns are hidden: the next segments score as a fresh evaluation's."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(mem_len=5))
    first, second = segments(4, seed=1), segments(4, seed=2)
    with inference_context(model) as ctx:
        want = model_evaluation(model, second, ctx)
        ring = StaticEval(model, ctx, compile=False)
        for x, y in first:
            ring(x, y)
        ring.reset()
        got = [ring(x, y).clone() for x, y in second]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    assert ring.sums()[1] == B * 4 * T


def test_the_rings_in_bf16_on_cudas_path_pass_cudas_rules():
    """The captured segment's twin where it can run: the model resolved for CUDA, in bf16 autocast, its segment
    compiled (aot_eager) and traced under CUDA's autocast with each graph judged by CUDA's operand rules, and the
    uncompiled segment (a split's last, shorter one) run under them too; the per-token NLL equals the model's
    evaluation under the same rules to bf16 rounding."""
    from txl.testing.cuda_rules import JudgingBackend, cuda_autocast, cuda_rules

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(mem_len=7, cutoffs=[20, 40]), resolve(txl.ComputeConfig(), "cuda"))
    batches = segments(6, last=2)
    backend = JudgingBackend()
    with inference_context(model) as ctx, torch.autocast("cpu", dtype=torch.bfloat16):
        with cuda_rules():
            want = model_evaluation(model, batches, ctx)
        ring = StaticEval(model, ctx, backend=backend)
        with cuda_autocast():
            got = [ring(x, y).clone() for x, y in batches[:-1]]
        with cuda_rules():
            got.append(ring(*batches[-1]).clone())
    torch._dynamo.reset()
    assert ring.keys[0].dtype == torch.bfloat16  # the rings hold what the layers' matmuls make
    assert {"mm", "nll_loss_forward", "index_copy", "gather"} <= backend.seen
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_captured_segment_equals_the_models_evaluation_on_cuda():
    """On CUDA: inductor's segment, warmed up, captured as one CUDA graph and replayed, gives the model's per-token
    NLL (fp32, TF32 off) over 12 segments and a shorter last one; the graph is captured once."""
    from txl.runtime import matmul_precision

    torch.manual_seed(0)
    with matmul_precision(torch.device("cuda"), tf32=False):
        model = txl.TransformerXL(tiny_config(mem_len=7, cutoffs=[20, 40])).cuda()
        batches = [(x.cuda(), y.cuda()) for x, y in segments(13, last=2)]
        with inference_context(model) as ctx:
            want = model_evaluation(model, batches, ctx)
            ring = StaticEval(model, ctx)
            got = [ring(x, y).clone() for x, y in batches]
    assert ring.graph is not None and ring.capture
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
