"""txl.graphs: every step at one static shape (memory always mem_len rows, the unfilled ones hidden) equals the
plain model, in training (loss, NLL, memory, every gradient) and evaluation (with the key/value cache), while
the memory fills and after; compiled at static shapes it traces one graph and still equals eager.

The compiled tests use the ``aot_eager`` backend (dynamo's and autograd's graphs without inductor's code
generation, minutes on 2 cores); on CUDA, tests/test_gpu.py runs inductor with CUDA graphs.
"""

import pytest
import torch
from conftest import tiny_config

import txl
from txl.graphs import StaticSteps

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(atol=1e-5, rtol=1e-5)
CONTEXTS = {"plain": {}, "same_length": dict(same_length=True), "clamp_len": dict(clamp_len=3),
            "pre_ln": dict(pre_ln=True)}


def model_for(**changes) -> txl.TransformerXL:
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(mem_len=7, **changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # every bias matters
    return model


def train_segments(steps, model, tokens, T: int, n: int):
    """n training segments of T tokens, memory carried: (loss, nll, memory, {name: grad}) per segment."""
    memory, seen = None, []
    for s in range(n):
        x, y = tokens[:, T * s:T * (s + 1)], tokens[:, T * s + 1:T * (s + 1) + 1]
        model.zero_grad()
        out = steps(x, labels=y, memory=memory)
        out.loss.backward()
        memory = out.memory
        seen.append((out.loss.detach(), out.nll.detach(), memory,
                     {name: p.grad.clone() for name, p in model.named_parameters()}))
    return seen


def assert_same(got, want):
    for (loss_g, nll_g, mem_g, grad_g), (loss_w, nll_w, mem_w, grad_w) in zip(got, want, strict=True):
        torch.testing.assert_close(loss_g, loss_w, **TOL)
        torch.testing.assert_close(nll_g, nll_w, **TOL)
        assert [m.shape for m in mem_g] == [m.shape for m in mem_w]  # the caller sees the real rows alone
        for a, b in zip(mem_g, mem_w, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        for name in grad_w:
            torch.testing.assert_close(grad_g[name], grad_w[name], **TOL, msg=name)


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_static_training_equals_the_plain_model(context):
    """T 3 against mem_len 7: the memory holds 0, 3, 6, then 7 rows (full), and stays full."""
    model = model_for(**CONTEXTS[context]).train()
    tokens = torch.randint(0, 61, (2, 20))
    want = train_segments(model, model, tokens, T=3, n=5)
    got = train_segments(StaticSteps(model, compile=False), model, tokens, T=3, n=5)
    assert_same(got, want)


def evaluate_segments(steps, tokens, lengths, cache: bool):
    memory, kv, seen, start = None, txl.KVCache() if cache else None, [], 0
    with torch.no_grad():
        for T in lengths:
            x, y = tokens[:, start:start + T], tokens[:, start + 1:start + T + 1]
            out = steps(x, labels=y, memory=memory, kv_cache=kv)
            memory, kv, start = out.memory, out.kv_cache, start + T
            seen.append((out.nll, memory, kv))
    return seen


@pytest.mark.parametrize("cache", [True, False], ids=["kv_cache", "no_cache"])
@pytest.mark.parametrize("context", list(CONTEXTS))
def test_static_evaluation_equals_the_plain_model(context, cache):
    """Segments of 4 against mem_len 7 (filling, then full), and a shorter last one (run on the plain model)."""
    model = model_for(**CONTEXTS[context]).eval()
    tokens = torch.randint(0, 61, (3, 40))
    lengths = [4, 4, 4, 4, 2]
    want = evaluate_segments(model, tokens, lengths, cache)
    got = evaluate_segments(StaticSteps(model, compile=False), tokens, lengths, cache)
    for (nll_g, mem_g, kv_g), (nll_w, mem_w, kv_w) in zip(got, want, strict=True):
        torch.testing.assert_close(nll_g, nll_w, **TOL)
        for a, b in zip(mem_g, mem_w, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        if cache:
            assert kv_g.length == kv_w.length == mem_w[0].size(1)
            for a, b in zip(kv_g.keys + kv_g.values, kv_w.keys + kv_w.values, strict=True):
                torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_under_bf16_autocast_the_memory_keeps_the_models_dtype(train):
    """The memory goes in and comes out in the dtype the plain model keeps it in (its state dtype under autocast),
    and the numbers agree to bf16 rounding."""
    model = model_for().train(train)
    tokens = torch.randint(0, 61, (2, 20))
    steps = StaticSteps(model, compile=False)
    memory = memory_s = None
    kv = kv_s = None if train else txl.KVCache()
    with torch.set_grad_enabled(train), torch.autocast("cpu", dtype=torch.bfloat16):
        for s in range(4):
            x, y = tokens[:, 3 * s:3 * s + 3], tokens[:, 3 * s + 1:3 * s + 4]
            want = model(x, labels=y, memory=memory, kv_cache=kv)
            got = steps(x, labels=y, memory=memory_s, kv_cache=kv_s)
            assert [m.dtype for m in got.memory] == [m.dtype for m in want.memory]
            assert [m.shape for m in got.memory] == [m.shape for m in want.memory]
            torch.testing.assert_close(got.nll, want.nll, atol=2e-2, rtol=2e-2)
            memory, memory_s, kv, kv_s = want.memory, got.memory, want.kv_cache, got.kv_cache


def test_a_longer_evaluation_memory_is_the_static_length():
    """context.mem_len (evaluation's, longer than training's) sets the rows; the plain model agrees."""
    model = model_for().eval()
    tokens = torch.randint(0, 61, (2, 30))
    ctx = model.config.context(mem_len=10)
    memory = memory_s = None
    steps = StaticSteps(model, compile=False)
    with torch.no_grad():
        for s in range(5):
            x = tokens[:, 4 * s:4 * s + 4]
            want = model(x, memory=memory, context=ctx)
            got = steps(x, memory=memory_s, context=ctx)
            torch.testing.assert_close(got.log_probs, want.log_probs, **TOL)
            memory, memory_s = want.memory, got.memory
    assert memory_s[0].size(1) == 10


@pytest.mark.slow  # torch.compile (14 s loaded)
def test_compiled_static_steps_trace_one_graph_and_equal_eager():
    """Training then evaluation through torch.compile at static shapes: each compiles once although the
    memory grows (0, 3, 6, 7 rows), and the numbers are eager's."""
    torch._dynamo.reset()
    model = model_for().train()
    tokens = torch.randint(0, 61, (2, 20))
    want = train_segments(model, model, tokens, T=3, n=4)
    steps = StaticSteps(model, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every fill level
        got = train_segments(steps, model, tokens, T=3, n=4)
    assert_same(got, want)
    model.eval()
    want = evaluate_segments(model, tokens, [3, 3, 3, 3], cache=True)
    torch._dynamo.reset()
    steps = StaticSteps(model, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = evaluate_segments(steps, tokens, [3, 3, 3, 3], cache=True)
    for (nll_g, _, _), (nll_w, _, _) in zip(got, want, strict=True):
        torch.testing.assert_close(nll_g, nll_w, **TOL)


def test_absolute_encodings_and_ext_len_are_refused_in_one_line():
    with pytest.raises(ValueError, match="attn_type='absolute' adds absolute positions"):
        StaticSteps(txl.TransformerXL(tiny_config(attn_type="absolute")))
    with pytest.raises(ValueError, match="a compressed memory .cmem_len=4. does not take: turn graphs off"):
        StaticSteps(txl.TransformerXL(tiny_config(cmem_len=4, cmem_rate=2)))
    model = model_for()
    steps = StaticSteps(model, compile=False)
    with pytest.raises(ValueError, match="ext_len 0"):
        steps(torch.zeros(1, 4, dtype=torch.long), context=model.config.context(ext_len=1))
    with pytest.raises(ValueError, match="more than mem_len=7"):
        steps(torch.zeros(1, 4, dtype=torch.long), memory=model.init_memory(1, 8))


def test_a_training_run_with_graphs_equals_one_without(corpus, tmp_path, monkeypatch):
    """txl.train with train.graphs and eval.graphs (through aot_eager here): the same losses and weights as the
    plain run (segments of 4 against mem_len 6; the test split's shorter last segment runs plain)."""
    import txl.train
    from txl import checkpoint as ckpt
    from txl import graphs, static_eval
    from txl.config import DataConfig, EvalConfig, RunConfig, TrainConfig
    from txl.data.corpora import load_run_corpus

    monkeypatch.setattr(graphs, "compile_static",
                        lambda model, backend=None: torch.compile(model, backend="aot_eager", dynamic=False))
    monkeypatch.setattr(static_eval, "compile_segment", lambda backend=None: torch.compile(
        static_eval.ring_segment, backend="aot_eager", dynamic=False))  # eval.graphs: the rings
    results = []
    for on in (False, True):
        torch._dynamo.reset()
        cfg = RunConfig(data=DataConfig(corpus=corpus, level="byte"), model=tiny_config(vocab_size=256),
                        eval=EvalConfig(graphs=on, batch_size=2),
                        train=TrainConfig(out_dir=str(tmp_path / f"run{on}"), max_steps=4, batch_size=2, tgt_len=4,
                                          progress=False, tensorboard=False, plot=False, eval_batches=2,
                                          eval_interval=0, device="cpu", precision="fp32", sample_tokens=0,
                                          graphs=on))
        result = txl.train.train(cfg, corpus=load_run_corpus(cfg.data))
        results.append((result, ckpt.load(result.out_dir).model.state_dict()))
    (plain, w_plain), (graphed, w_graphed) = results
    assert graphed.steps == plain.steps == 4
    assert graphed.test.tokens == plain.test.tokens
    assert graphed.test.loss == pytest.approx(plain.test.loss, rel=1e-5)
    assert graphed.valid.loss == pytest.approx(plain.valid.loss, rel=1e-5)
    for name, value in w_plain.items():
        torch.testing.assert_close(w_graphed[name], value, **TOL, msg=name)


def test_txl_eval_with_graphs_equals_without(corpus, tmp_path, monkeypatch, capsys):
    """``txl eval --graphs`` (through aot_eager here) prints the figures of ``txl eval``: the same loss on the same
    tokens, memory filling past mem_len (the relative model: over rings, ``txl.static_eval``)."""
    import txl.train
    from txl import static_eval
    from txl.cli import main
    from txl.config import DataConfig, EvalConfig, RunConfig, TrainConfig
    from txl.data.corpora import load_run_corpus

    calls = []

    def aot_eager(backend=None):
        calls.append(backend)
        return torch.compile(static_eval.ring_segment, backend="aot_eager", dynamic=False)

    monkeypatch.setattr(static_eval, "compile_segment", aot_eager)
    cfg = RunConfig(data=DataConfig(corpus=corpus, level="byte"), model=tiny_config(vocab_size=256),
                    train=TrainConfig(out_dir=str(tmp_path / "run"), max_steps=2, batch_size=2, tgt_len=4,
                                      progress=False, tensorboard=False, plot=False, eval_batches=1, eval_interval=0,
                                      device="cpu", precision="fp32", sample_tokens=0))
    txl.train.train(cfg, corpus=load_run_corpus(cfg.data))
    figures = []
    for flags in ([], ["--graphs"]):
        torch._dynamo.reset()
        capsys.readouterr()
        assert main(["eval", str(tmp_path / "run"), "--max-batches", "5", "--no-progress", *flags]) == 0
        line = next(r for r in capsys.readouterr().out.splitlines() if ": loss " in r)
        figures.append(line.split(" tokens, ")[0])  # "mem_len 6, tgt_len 4, keys/query 7-10: loss ..., 200"
    assert len(calls) == 1  # the flag reached txl.static_eval
    assert figures[0] == figures[1] and "loss" in figures[0]
    assert main(["eval", str(tmp_path / "run"), "--graphs", "--compile"]) == 2
    assert "--graphs already compiles" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "run"), "--graphs", "--eval.compile", "true"]) == 2  # a flag and a field
    assert "EvalConfig.compile and EvalConfig.graphs are both set" in capsys.readouterr().err
    with pytest.raises(ValueError, match="EvalConfig.compile and EvalConfig.graphs are both set"):
        EvalConfig(compile=True, graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_equal_eager_on_cuda():
    """Inductor with CUDA graphs (reduce-overhead) at static shapes: training (fp32, TF32 off) and evaluation
    with the key/value cache give eager's numbers, and no graph is skipped (every step replays one)."""
    from torch._dynamo.utils import counters

    from txl.runtime import matmul_precision

    torch._dynamo.reset()
    counters.clear()
    with matmul_precision(torch.device("cuda"), tf32=False):
        model = model_for().cuda().train()
        tokens = torch.randint(0, 61, (2, 40), device="cuda")
        want = train_segments(model, model, tokens, T=3, n=6)
        got = train_segments(StaticSteps(model), model, tokens, T=3, n=6)
        for (loss_g, nll_g, mem_g, grad_g), (loss_w, nll_w, mem_w, grad_w) in zip(got, want, strict=True):
            torch.testing.assert_close(loss_g, loss_w, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(nll_g, nll_w, atol=1e-4, rtol=1e-4)
            for a, b in zip(mem_g, mem_w, strict=True):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            for name in grad_w:
                torch.testing.assert_close(grad_g[name], grad_w[name], atol=1e-4, rtol=1e-3, msg=name)
        model.eval()
        want = evaluate_segments(model, tokens, [4] * 8, cache=True)
        got = evaluate_segments(StaticSteps(model), tokens, [4] * 8, cache=True)
        for (nll_g, _, _), (nll_w, _, _) in zip(got, want, strict=True):
            torch.testing.assert_close(nll_g, nll_w, atol=1e-4, rtol=1e-4)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.slow  # torch.compile (aot_eager) of a training and an evaluation step
def test_static_steps_in_bf16_on_cudas_path_pass_cudas_rules():
    """The CUDA-graphs test's twin where it can run: the static steps compiled (aot_eager: no CUDA graphs here) in bf16
    on the model resolved for CUDA, traced under CUDA's autocast and each graph judged by CUDA's operand rules
    (``txl.testing.cuda_rules``); training and evaluation with the key/value cache equal eager's to bf16 rounding."""
    from txl.model import plan
    from txl.testing.cuda_rules import JudgingBackend, cuda_autocast, cuda_rules

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(mem_len=7), plan.resolve(txl.ComputeConfig(), "cuda"))
    tokens = torch.randint(0, 61, (2, 40))
    bf16 = dict(atol=3e-2, rtol=3e-2)
    backend = JudgingBackend()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with cuda_rules():
            want = train_segments(model.train(), model, tokens, T=3, n=4)
        with cuda_autocast():
            got = train_segments(StaticSteps(model, backend=backend), model, tokens, T=3, n=4)
        for (loss_g, nll_g, _, _), (loss_w, nll_w, _, _) in zip(got, want, strict=True):
            torch.testing.assert_close(loss_g, loss_w, **bf16)
            torch.testing.assert_close(nll_g, nll_w, **bf16)
        model.eval()
        torch._dynamo.reset()
        with cuda_rules():
            want = evaluate_segments(model, tokens, [4] * 4, cache=True)
        with cuda_autocast():
            got = evaluate_segments(StaticSteps(model, backend=backend), tokens, [4] * 4, cache=True)
        for (nll_g, _, _), (nll_w, _, _) in zip(got, want, strict=True):
            torch.testing.assert_close(nll_g, nll_w, **bf16)
    torch._dynamo.reset()
    assert {"native_layer_norm", "native_layer_norm_backward", "mm", "nll_loss_forward"} <= backend.seen


def test_graphs_with_fsdp_are_refused_before_the_run(tmp_path):
    import txl.train
    from txl.config import DataConfig, RunConfig, TrainConfig
    from txl.distributed import DistInfo

    cfg = RunConfig(data=DataConfig(corpus="x", level="byte"), model=tiny_config(),
                    train=TrainConfig(out_dir=str(tmp_path), graphs=True, parallel="fsdp", device="cpu"))
    with pytest.raises(ValueError, match="train.graphs=.model. runs the model at static shapes .* --train.parallel"):
        txl.train.check_run(cfg, DistInfo(rank=0, world_size=1, device=torch.device("cpu")))
