"""txl.step_graph: the whole training step over static buffers, as CUDA captures it, checked where no GPU is.

On the CPU nothing is captured, but what a capture needs is checkable: the compiled step (aot_eager here; inductor
under slow) equals eager ``train_step`` over 20 steps, with gradient accumulation and across a resume; torch.compile
makes one graph and never recompiles while the memory fills; the buffers the step reads and writes keep their
storage from step to step; and nothing inside the step reads a value back to the host (a dispatch-mode counter,
shown to count on the plain CPU model, which syncs).
"""

import copy
import json

import pytest
import torch
from conftest import HostSyncs, tiny_config
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import txl
from txl.config import ComputeConfig, DataConfig, EvalConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from txl.data import Batch
from txl.distributed import init_distributed
from txl.model.plan import resolve
from txl.optim import build_optimizer
from txl.step_graph import StepGraph, graphs_mode, with_float_lr
from txl.train import train_step

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(atol=2e-5, rtol=2e-5)
"""The compiled step adds in another order than eager (aot_eager decomposes some ops; inductor fuses): float32
rounding, compounded by Adam over 20 steps, stays under this on the tiny model."""
STEPS, T, B = 20, 3, 4
OPTIM = OptimConfig(lr=3e-3, clip=0.25)


def setup(config: ModelConfig, compute: ComputeConfig | None = None):
    torch.manual_seed(0)
    model = txl.TransformerXL(config, compute)
    return model, build_optimizer(model, OPTIM), torch.amp.GradScaler("cpu", enabled=False)


def segments(n: int, start: int = 0):
    tokens = torch.randint(0, 61, (B, T * (STEPS + 1) + 1), generator=torch.Generator().manual_seed(1))
    for s in range(start, n):
        yield Batch(tokens[:, T * s:T * s + T], tokens[:, T * s + 1:T * s + T + 1], context_len=0, start=T * s)


def run(step, model, memories, batches) -> list:
    """Each step's (loss, tokens, grad norm) as numbers, and the memories after the last."""
    seen = []
    for batch in batches:
        stats, memories = step(batch, memories)
        seen.append((float(stats.loss), int(stats.tokens), float(stats.grad_norm)))
    return seen, memories


def eager(model, optimizer, scaler, info):
    return lambda batch, memories: train_step(model, optimizer, scaler, batch, memories, lr=OPTIM.lr, clip=OPTIM.clip,
                                              precision="fp32", info=info)


def graphed(model, optimizer, scaler, info, backend):
    graph = StepGraph(model, optimizer, scaler, step=train_step, backend=backend, clip=OPTIM.clip, precision="fp32",
                      info=info)
    return graph, lambda batch, memories: graph(batch, memories, lr=OPTIM.lr)


def assert_same_run(got, want, model_got, model_want, memories_got, memories_want):
    for g, w in zip(got, want, strict=True):
        assert g[1] == w[1]
        assert g[0] == pytest.approx(w[0], rel=TOL["rtol"], abs=TOL["atol"])
        assert g[2] == pytest.approx(w[2], rel=TOL["rtol"], abs=TOL["atol"])
    for (name, p), q in zip(model_want.named_parameters(), model_got.parameters(), strict=True):
        torch.testing.assert_close(q, p, **TOL, msg=name)
    for mg, mw in zip(memories_got, memories_want, strict=True):
        assert [t.shape for t in mg] == [t.shape for t in mw]  # the real rows alone
        for a, b in zip(mg, mw, strict=True):
            torch.testing.assert_close(a, b, **TOL)


def check_compiled_step(backend_name: str, grad_accum: int):
    info = init_distributed("cpu")
    config = tiny_config(mem_len=7)  # T 3: the memory holds 0, 3, 6, then 7 rows and stays full
    want_model, opt, scaler = setup(config)
    want, want_mem = run(eager(want_model, opt, scaler, info), want_model, [None] * grad_accum, segments(STEPS))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend_name)
    model, opt, scaler = setup(config)
    graph, step = graphed(model, opt, scaler, info, counter)
    half = STEPS // 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        first, memories = run(step, model, [None] * grad_accum, segments(half))
    assert counter.frame_count == 1  # one graph (a break would make two), no recompilation as the memory filled

    # A resume: the state a checkpoint keeps (weights, optimiser with float rates, the memories' real rows) in a
    # new model, optimiser and step, which builds its own buffers (and, on CUDA, its own capture).
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(with_float_lr(opt.state_dict())),
             [tuple(t.clone() for t in m) for m in memories])
    assert all(isinstance(g["lr"], float) for g in saved[1]["param_groups"])
    torch._dynamo.reset()
    model, opt, scaler = setup(config)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    graph, step = graphed(model, opt, scaler, info, counter)
    second, memories = run(step, model, saved[2], segments(STEPS, start=half))
    assert_same_run(first + second, want, model, want_model, memories, want_mem)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_compiled_step_equals_eager_over_20_steps_and_a_resume(grad_accum):
    """aot_eager (dynamo's and autograd's graphs without code generation): losses, token counts, gradient norms,
    weights and memories equal eager's within TOL, one graph throughout, and a resumed step continues the run."""
    check_compiled_step("aot_eager", grad_accum)


@pytest.mark.slow
def test_the_inductor_step_equals_eager_over_20_steps_and_a_resume():
    """The same through inductor's CPU code (C++ kernels; minutes to compile on a busy 2-core machine)."""
    check_compiled_step("inductor", 2)


def test_a_shorter_segment_runs_the_plain_step_and_the_next_takes_its_memory_back():
    """An epoch's last segment is shorter (the iterator's ceil): it runs the plain ``train_step`` on the memory's
    real rows (copied out of the buffers first), and the next full segment copies that memory back in."""
    info = init_distributed("cpu")
    config = tiny_config(mem_len=7)
    tokens = torch.randint(0, 61, (B, 40), generator=torch.Generator().manual_seed(2))
    cuts = [(0, 3), (3, 6), (6, 9), (9, 11), (11, 14), (14, 17)]  # the fourth segment is 2 tokens long
    batches = [Batch(tokens[:, a:b], tokens[:, a + 1:b + 1], context_len=0, start=a) for a, b in cuts]
    want_model, opt, scaler = setup(config)
    want, want_mem = run(eager(want_model, opt, scaler, info), want_model, [None], batches)
    torch._dynamo.reset()
    model, opt, scaler = setup(config)
    _, step = graphed(model, opt, scaler, info, "aot_eager")
    got, memories = run(step, model, [None], batches)
    assert_same_run(got, want, model, want_model, memories, want_mem)


def test_a_step_that_cannot_be_captured_runs_on_uncaptured_and_says_why(monkeypatch, caplog):
    """A capture that fails (here: refused as it starts) leaves the weights as they were: the step runs uncaptured
    then and from then on, with one warning naming the error; the run equals eager's."""
    import contextlib

    @contextlib.contextmanager
    def refusing(graph):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", refusing)
    info = init_distributed("cpu")
    want_model, opt, scaler = setup(tiny_config(mem_len=7))
    want, want_mem = run(eager(want_model, opt, scaler, info), want_model, [None], segments(4))
    model, opt, scaler = setup(tiny_config(mem_len=7))
    graph = StepGraph(model, opt, scaler, step=train_step, capture=True, warmup=0, compile=False, clip=OPTIM.clip,
                      precision="fp32",
                      info=info)
    with caplog.at_level("WARNING", logger="txl.step_graph"):
        got, memories = run(lambda b, m: graph(b, m, lr=OPTIM.lr), model, [None], segments(4))
    assert not graph.capture and graph.graph is None
    assert [r.getMessage() for r in caplog.records] == [
        "the training step could not be captured as a CUDA graph (operation not permitted when stream is capturing); "
        "it runs uncaptured from here on (--train.graphs model or off choose another way)"]
    assert_same_run(got, want, model, want_model, memories, want_mem)


def counted(mode: TorchDispatchMode, fn):
    def run():
        with mode:
            fn()
    return run


def test_the_step_keeps_its_buffers_and_reads_nothing_back(monkeypatch):
    """CUDA's resolved model (cluster_rows 'all'), compiled through aot_eager: over 6 steps the buffers' data pointers
    never change, the memories handed out are views of them, and no op inside the step syncs with the device; the
    counter does count: the plain CPU model ('selected' rows: nonzero) syncs.

    Under a dispatch mode torch.compile runs the frame's own ops (the ones its graph is traced from), so the
    counter sees the model's boundary checks too: on a CPU they read token ids on the host, where reading is free
    (``reads_values``); here they behave as on CUDA, where they read nothing."""
    from txl.model import transformer

    monkeypatch.setattr(transformer, "reads_values", lambda t: False)
    info = init_distributed("cpu")
    model, opt, scaler = setup(tiny_config(mem_len=7, cutoffs=[20, 40]), resolve(ComputeConfig(), "cuda"))
    graph, step = graphed(model, opt, scaler, info, "aot_eager")
    memories, pointers = [None], None
    reads = HostSyncs()
    for s, batch in enumerate(segments(6)):
        if s == 0:
            stats, memories = step(batch, memories)  # allocates and compiles
            continue
        monkeypatch.setattr(graph, "body", counted(reads, graph.body))  # the step alone (what a capture records)
        stats, memories = step(batch, memories)
        monkeypatch.undo()
        monkeypatch.setattr(transformer, "reads_values", lambda t: False)
        buffers = graph.static
        now = [t.data_ptr() for t in (buffers["input_ids"], buffers["labels"], buffers["stats"], graph.lr,
                                      *buffers["padding"], *buffers["memory"][0])]
        assert pointers is None or now == pointers
        pointers = now
        for handed, buf in zip(memories[0], buffers["memory"][0], strict=True):
            assert handed.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert reads.seen == []

    plain = txl.TransformerXL(tiny_config(mem_len=7, cutoffs=[20, 40]))  # the CPU's own path: 'selected' rows
    batch = next(segments(1))
    with HostSyncs() as control:
        train_step(plain, build_optimizer(plain, OPTIM), scaler, batch, [None], lr=OPTIM.lr, clip=OPTIM.clip,
                   precision="fp32", info=info)
    assert "aten::nonzero" in control.seen


def test_around_the_replay_the_host_launches_four_ops(monkeypatch):
    """With the body captured (stubbed here: what a replay leaves the host), a step launches the inputs' and labels'
    copies into their buffers, the rate's fill and the figures' clone, nothing else, whatever the model; the body
    itself (NVIDIA's structure: 16 layers, 3 tail clusters) is ~940 launches (benchmarks.launches counts them)."""
    from benchmarks.launches import _Dispatched

    info = init_distributed("cpu")
    model, opt, scaler = setup(tiny_config(mem_len=7))
    graph = StepGraph(model, opt, scaler, step=train_step, compile=False, clip=OPTIM.clip, precision="fp32", info=info)
    memories = [None]
    batches = list(segments(5))
    for batch in batches[:4]:  # the memory full: no padding mask to rewrite any more
        _, memories = graph(batch, memories, lr=OPTIM.lr)
    monkeypatch.setattr(graph, "body", lambda: None)
    with _Dispatched() as host:
        graph(batches[4], memories, lr=OPTIM.lr)
    launched = {name: n for name, n in host.ops.items() if name not in ("aten::alias", "aten::unbind")}
    assert host.launched == 4 and launched == {"aten::copy_": 2, "aten::fill_": 1, "aten::clone": 1}


@pytest.mark.parametrize(("changes", "device", "want"), [
    ({}, "cuda", ("step", None)),
    ({}, "cpu", ("off", None)),
    (dict(graphs="step"), "cpu", ("step", None)),
    (dict(graphs=True), "cuda", ("model", None)),  # the older boolean
    (dict(graphs=False), "cuda", ("off", None)),
    (dict(var_len=True), "cuda", ("off", "var_len changes the segment length")),
    (dict(var_len=True, graphs="step"), "cuda", ("model", "var_len changes the segment length")),
    (dict(activation_checkpointing=True), "cuda", ("off", "activation checkpointing")),
    (dict(parallel="fsdp"), "cuda", ("off", "FSDP2 gathers and frees parameters")),
])
def test_auto_captures_the_step_on_cuda_and_names_what_it_cannot(changes, device, want):
    cfg = RunConfig(model=tiny_config(), train=TrainConfig(**changes))
    mode, why = graphs_mode(cfg, torch.device(device), 1)
    assert mode == want[0]
    assert (why is None) == (want[1] is None) and (want[1] is None or want[1] in why)


@pytest.mark.parametrize(("model", "world", "why"), [
    (dict(attn_type="absolute"), 1, "adds absolute positions"),
    (dict(cmem_len=4, cmem_rate=2), 1, "compressed memory"),
    (dict(ext_len=2), 1, "ext_len=2 re-feeds rows"),
    (dict(mem_len=0), 1, "mem_len 0"),
    ({}, 2, "2 processes: DDP inside a captured step"),
])
def test_what_falls_back_says_why(model, world, why):
    cfg = RunConfig(model=tiny_config(**model), train=TrainConfig(tgt_len=4))
    mode, reason = graphs_mode(cfg, torch.device("cuda"), world)
    assert mode == "off" and why in reason


def test_a_training_run_through_the_captured_step_equals_one_without(corpus, tmp_path, monkeypatch):
    """txl.train with train.graphs 'step' (aot_eager here, the CPU running what CUDA captures): the same losses and
    weights as 'off', through a checkpoint and a resume half-way (the step rebuilt from the checkpoint)."""
    import txl.train
    from txl import checkpoint as ckpt
    from txl import step_graph
    from txl.data.corpora import load_run_corpus

    monkeypatch.setattr(step_graph, "compile_step_model",
                        lambda model, backend=None: torch.compile(model, backend="aot_eager", dynamic=False))
    results = []
    for graphs in ("off", "step"):
        torch._dynamo.reset()
        common = dict(batch_size=4, grad_accum=2, tgt_len=4, progress=False, tensorboard=False, plot=False,
                      eval_batches=2, eval_interval=0, ckpt_interval=3, device="cpu", precision="fp32",
                      sample_tokens=0, graphs=graphs, log_interval=2)
        cfg = RunConfig(data=DataConfig(corpus=corpus, level="byte"), model=tiny_config(vocab_size=256),
                        eval=EvalConfig(batch_size=2), optim=OPTIM,
                        train=TrainConfig(out_dir=str(tmp_path / graphs), max_steps=3, **common))
        corp = load_run_corpus(cfg.data)
        txl.train.train(cfg, corpus=corp)
        cfg = cfg.replace(train=TrainConfig(out_dir=str(tmp_path / graphs), max_steps=6, **common))
        result = txl.train.train(cfg, corpus=corp, resume=tmp_path / graphs)
        rows = [json.loads(r) for r in (tmp_path / graphs / "metrics.jsonl").read_text().splitlines()]
        rows = [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in rows if r["kind"] == "train"]
        results.append((result, ckpt.load(result.out_dir).model.state_dict(), rows))
    (plain, w_plain, rows_plain), (graphed_run, w_graphed, rows_graphed) = results
    assert graphed_run.steps == plain.steps == 6
    assert [r[0] for r in rows_graphed] == [r[0] for r in rows_plain] == [2, 3, 4, 6]  # read at the log interval
    for g, w in zip(rows_graphed, rows_plain, strict=True):
        assert g[3] == w[3] and g[1:3] == pytest.approx(w[1:3], rel=1e-5)
    assert graphed_run.test.loss == pytest.approx(plain.test.loss, rel=1e-5)
    for name, value in w_plain.items():
        torch.testing.assert_close(w_graphed[name], value, **TOL, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("precision", "kernels"), [("fp32", "compiled"), ("fp32", "eager"), ("bf16", "compiled"),
                                                     ("fp16", "compiled")])
def test_the_captured_step_equals_eager_on_cuda(precision, kernels):
    """On CUDA: warm-up, capture, then replays; 12 steps with accumulation (the memory fills over the first three)
    equal eager ``train_step`` (fp32 with TF32 off: within TOL-like bounds; bf16 and fp16: within their rounding),
    fp16 through the scaler, and the figures are read only after the run."""
    from txl.runtime import matmul_precision

    device = torch.device("cuda")
    info = init_distributed("cuda")
    config, compute = tiny_config(mem_len=7, cutoffs=[20, 40]), resolve(ComputeConfig(), "cuda")
    tol = dict(atol=1e-4, rtol=1e-4) if precision == "fp32" else dict(atol=2e-2, rtol=2e-2)
    runs, options = [], dict(clip=OPTIM.clip, precision=precision, info=info)
    with matmul_precision(device, tf32=False):
        for captured in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = txl.TransformerXL(config, compute).to(device).train()
            opt = build_optimizer(model, OPTIM, capturable=captured)
            scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
            if captured:
                graph = StepGraph(model, opt, scaler, step=train_step, compile=kernels == "compiled", **options)
                step = lambda b, m, graph=graph: graph(b, m, lr=OPTIM.lr)  # noqa: E731
            else:
                step = lambda b, m, model=model, opt=opt, scaler=scaler: train_step(  # noqa: E731
                    model, opt, scaler, b, m, lr=OPTIM.lr, **options)
            memories, figures = [None, None], []
            for batch in segments(12):
                batch = Batch(batch.input_ids.to(device), batch.labels.to(device), context_len=0, start=batch.start)
                stats, memories = step(batch, memories)
                figures.append(stats)
            runs.append(([(float(s.loss), float(s.grad_norm)) for s in figures], model, memories))
            if captured:
                assert graph.graph is not None  # captured, and replayed from then on
    (want, model_want, mem_want), (got, model_got, mem_got) = runs
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=tol["rtol"] * 10, abs=tol["atol"] * 10)
    for (name, p), q in zip(model_want.named_parameters(), model_got.parameters(), strict=True):
        torch.testing.assert_close(q, p, **tol, msg=name)
    for mg, mw in zip(mem_got, mem_want, strict=True):
        for a, b in zip(mg, mw, strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol)
