"""The static-buffer decode step (``txl.captured_step``, the serving runner's ``graphs='on'``) run where there is no
GPU: what a CUDA graph needs of it, checked on the CPU.

* it generates what the eager engine generates, greedy and seeded token for token, log-probs and kept rows within
  float tolerance, while rows join, leave, come back and the buffers grow;
* one graph per batch bucket (a counting torch.compile backend around ``aot_eager``, static shapes): no recompile
  from step to step, nor when rows join and leave within a bucket;
* the buffers a graph reads keep their addresses from step to step;
* no host sync inside a step (``conftest.HostSyncs``: a dispatch mode counting what reads a device value on the
  host or copies host data in), nor in the runner's whole step once its rows are seated: the next input is the last
  step's token, on the device; the host reads the drawn ids with one small copy, outside the step.
"""

import pytest
import torch
from conftest import Counting, HostSyncs, perturbed_model

from txl.decoding import Picker
from txl.serve.runner import Drawn, Model, Unit, draw

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

V = 61


def generate(m: Model, steps: int, away: range = range(0)) -> tuple[list[list[int]], list, list]:
    """Three generations batched (greedy, seeded sampling, greedy with a repetition penalty), from prompts of
    different lengths after memories of different lengths; row 1 sits out the steps in ``away`` (its rows leave
    the batch and come back). Each row's tokens, every step's log-probs, and each row's kept rows at the end."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 3, 7)]
    memories = [None, torch.randn(2, 4, 32, generator=g), torch.randn(2, 8, 32, generator=g)]
    picks = [Picker(temperature=0.0, vocab_size=V, device=m.device),
             Picker(temperature=1.0, seeds=[3], vocab_size=V, device=m.device),
             Picker(temperature=0.0, repetition_penalty=1.3, vocab_size=V, device=m.device)]
    results = [m.run("prefill", [Unit("prefill", p, mem, pick=k)])[0] for p, mem, k in zip(prompts, memories, picks)]
    tokens = [[r.drawn[0].get(r.drawn[1])[0]] for r in results]
    log_probs = []
    for s in range(steps):
        live = [0, 2] if s in away else [0, 1, 2]
        units = [Unit("step", [tokens[b][-1]], row=results[b].row, pick=picks[b], after=results[b].drawn)
                 for b in live]
        for b, r in zip(live, m.run("step", units)):
            results[b] = r
            tokens[b].append(r.drawn[0].get(r.drawn[1])[0])
            log_probs.append(r.next_log_probs)
    return tokens, log_probs, [r.row[0].take(r.row[1]) for r in results]


@pytest.mark.parametrize("clamp_len, overrides", [(0, {}), (20, {"pre_ln": True, "untie_r": True})])
def test_the_static_step_generates_what_the_eager_engine_generates(clamp_len, overrides):
    """150 steps (the ring outgrows its first 128 columns and is copied into 256), row 1 away for 20 of them:
    the same tokens (greedy, seeded, penalised), log-probs and kept memory, keys and values as the eager engine."""
    model = perturbed_model(**overrides)
    ctx = dict(segment_len=8, mem_len=8, same_length=False, clamp_len=clamp_len)
    eager = generate(Model(model, graphs="off", **ctx), 150, away=range(40, 60))
    static_model = Model(model, graphs="on", **ctx)
    static = generate(static_model, 150, away=range(40, 60))
    assert static_model.slots is not None and static_model.slots.C == 256
    assert static[0] == eager[0]
    for a, b in zip(static[1], eager[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for (mem_a, kv_a), (mem_b, kv_b) in zip(static[2], eager[2]):
        torch.testing.assert_close(mem_a, mem_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_a, kv_b, atol=1e-5, rtol=1e-5)


def test_one_graph_per_bucket_and_the_buffers_stay_put():
    """Through a counting backend, 50 steps of rows joining and leaving: three rows, a fourth joining for 10 steps
    and leaving (all bucket 4: one graph), two rows alone for 10 (bucket 2: a second graph, the two moved down),
    three again (bucket 4's graph again, no third); every buffer a graph reads at the same address throughout."""
    backend = Counting()
    m = Model(perturbed_model(), segment_len=8, mem_len=8, same_length=False, clamp_len=0, graphs="on",
              graph_backend=backend)
    pick = Picker(temperature=0.0, vocab_size=V)
    rows = [m.run("prefill", [Unit("prefill", list(range(1, n)), None, pick=pick)])[0] for n in (4, 6, 3, 8)]
    buffers, counts = None, []
    for s in range(50):
        live = [0, 1, 2, 3] if 10 <= s < 20 else [0, 1] if 30 <= s < 40 else [0, 1, 2]
        out = m.run("step", [Unit("step", [0], row=rows[b].row, pick=pick, after=rows[b].drawn) for b in live])
        for b, r in zip(live, out):
            rows[b] = r
        slots = m.slots
        now = [t.data_ptr() for t in (slots.memory, slots.keys, slots.values, slots.ids, slots.lens, slots.cols,
                                      *slots.table)]
        assert buffers is None or now == buffers, s
        buffers = now
        counts.append(backend.graphs)
    assert counts[29] == 1 and counts[-1] == 2 and backend.runs == 50
    assert m.slots.R == 4 and m.slots.C == 128  # never regrown


def test_no_host_sync_inside_a_step():
    """The step function reads no device value on the host and copies no host data in, whatever the adaptive
    softmax (clusters resolved as on a GPU: every cluster scores every row, no data-dependent shape); nor does
    the runner's whole step once the rows are seated and their inputs are the last step's tokens on the device
    (the host learns the tokens from ``Drawn.get`` after it)."""
    model = perturbed_model(cutoffs=[20, 40], div_val=2, cluster_rows="all")
    m = Model(model, segment_len=8, mem_len=8, same_length=False, clamp_len=0, graphs="on")
    pick = Picker(temperature=0.0, vocab_size=V)
    rows = [m.run("prefill", [Unit("prefill", p, None, pick=pick)])[0] for p in ([1, 2, 3], [4, 5, 6, 7])]
    units = [Unit("step", [0], row=r.row, pick=pick, after=r.drawn) for r in rows]
    rows = m.run("step", units)  # rows seated, the slot index made
    slots = m.slots
    with HostSyncs() as inside, torch.no_grad():
        slots.graphs(4, slots.ids, slots.memory.unbind(0), slots.keys.unbind(0), slots.values.unbind(0),
                     slots.table, slots.lens, slots.cols)
    assert inside.seen == []
    slots.col = (slots.col + 1) % slots.C  # the host's copy of the column, as Slots.step keeps it
    for s in slots.seats:
        if s is not None:
            s.length += 1
    with HostSyncs() as whole:
        rows = m.run("step", [Unit("step", [0], row=r.row, pick=pick, after=r.drawn) for r in rows])
    assert whole.seen == []
    with HostSyncs() as control:  # the counter sees what it counts
        t = torch.tensor([0, 3])
        int(t.sum()), t.nonzero()
    assert control.seen == ["aten::lift_fresh", "aten::_local_scalar_dense", "aten::nonzero"]


def test_the_host_sync_counter_counts_copies_to_the_host_by_one_rule():
    """``HostSyncs``' rule for copies, whichever op copies: device to host counts, host to device and a device's own
    copies do not (a non-CPU tensor without a device: 'meta', whose data is never touched here)."""
    cpu, dev = torch.zeros(2), torch.empty(2, device="meta")
    to_host = HostSyncs.to_host
    assert to_host("aten::_to_copy", (dev,), {"device": torch.device("cpu")})  # .cpu(), .to("cpu")
    assert to_host("aten::copy_", (cpu, dev), {})  # into pinned (or any host) memory
    assert not to_host("aten::_to_copy", (cpu,), {"device": torch.device("meta")})  # onto the device
    assert not to_host("aten::copy_", (dev, cpu), {})
    assert not to_host("aten::_to_copy", (dev,), {"dtype": torch.float64})  # stays on the device
    assert not to_host("aten::copy_", (cpu, cpu), {})


def test_drawing_on_the_device_chooses_what_each_rows_picker_chooses():
    """``draw``: rows all greedy are one argmax with their log-probs; mixed rows each drawn by their own picker
    (a seed is the row's own: the same draw as that picker alone)."""
    g = torch.Generator().manual_seed(0)
    log_probs = torch.randn(3, V, generator=g).log_softmax(-1)
    greedy = draw(log_probs, [Picker(temperature=0.0, vocab_size=V)] * 3)
    want = log_probs.argmax(-1).tolist()
    assert [greedy.get(b)[0] for b in range(3)] == want
    assert [greedy.get(b)[1] for b in range(3)] == pytest.approx(log_probs.max(-1).values.tolist())
    mixed = draw(log_probs, [Picker(temperature=0.0, vocab_size=V), Picker(temperature=1.0, seeds=[7], vocab_size=V),
                             Picker(temperature=0.0, top_logprobs=2, vocab_size=V)])
    alone = Picker(temperature=1.0, seeds=[7], vocab_size=V)(log_probs[1:2])
    assert mixed.get(1)[0] == int(alone.tokens[0]) and mixed.get(0)[0] == want[0]
    assert [t for t, _ in mixed.get(2)[2]] == log_probs[2].topk(2).indices.tolist() and mixed.get(0)[2] is None
    assert isinstance(mixed, Drawn) and len(mixed) == 3


def test_the_runner_says_which_step_generates():
    """One line for the server's start-up: the static step where asked (uncaptured without CUDA), else the eager or
    compiled step and why; 'on' for a model the step cannot read is refused at start."""
    model = perturbed_model()
    ctx = dict(segment_len=8, mem_len=8, same_length=False, clamp_len=0)
    assert Model(model, **ctx).steps == "generation steps: eager, not captured (no CUDA device)"
    assert Model(model, graphs="off", compile=True, **ctx).steps == (
        "generation steps: compiled, not captured (--serve.graphs off)")
    assert "static-buffer decode step, not captured (no CUDA)" in Model(model, graphs="on", **ctx).steps
    absolute = perturbed_model(attn_type="absolute")
    assert "attn_type='absolute'" in Model(absolute, **ctx).steps
    with pytest.raises(ValueError, match=r"serve.graphs on: attn_type='absolute'.*--serve.graphs auto or off"):
        Model(absolute, graphs="on", **ctx)


@pytest.mark.slow  # inductor's code generation: ~30 s on a CPU
def test_the_static_step_compiled_by_inductor_generates_what_the_eager_engine_generates():
    """The step as a GPU compiles it before capture (``--serve.compile`` with graphs): inductor's kernels, here for
    the CPU, give the eager engine's tokens (greedy, seeded, penalised) with log-probs within 1e-4."""
    model = perturbed_model()
    ctx = dict(segment_len=8, mem_len=8, same_length=False, clamp_len=0)
    eager = generate(Model(model, graphs="off", **ctx), 20, away=range(8, 12))
    compiled = generate(Model(model, graphs="on", compile=True, **ctx), 20, away=range(8, 12))
    assert compiled[0] == eager[0]
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_a_generation_without_stop_rules_reads_its_tokens_after_its_last_step(tmp_path, monkeypatch, graphs):
    """A request with no stop text, stop token or stream lets its steps run on without the host reading a token
    (each step reads the last one's on the device); it reads them all after the last step, and generates what a
    streamed request generates (greedy and seeded), token for token."""
    from serve_util import loader, make_model_dir

    from txl.serve.engine import Engine
    from txl.serve.runner import Drawn
    from txl.serve.session import SessionState, SessionStore

    model, tokenizer, _ = loader(make_model_dir(tmp_path / "m"))()
    m = Model(model, segment_len=8, mem_len=8, same_length=False, clamp_len=0, graphs=graphs)
    engine = Engine(m, tokenizer, SessionStore(tmp_path / "s", max_in_memory=4, ttl=60), max_queue=4, max_batch=4,
                    durable=False, pipelined=True)  # the order CUDA resolves to
    job = type("Job", (), {"cancelled": False})()
    events: list[str] = []
    get = Drawn.get
    monkeypatch.setattr(Drawn, "get", lambda self, b: (events.append("read"), get(self, b))[1])
    outs = []
    for seed, streamed in ((None, False), (None, True), (5, False), (5, True)):
        state = SessionState(id="", tokens=list(engine.context_ids))
        work = engine.read_ids(state, [int(i) for i in tokenizer.encode_prompt("The cat sat")])
        try:
            unit = next(work)
            while True:
                unit = work.send(m.run(unit.kind, [unit])[0])
        except StopIteration:
            pass
        events.clear()
        work = engine.generate(state, max_tokens=12, temperature=0.0 if seed is None else 1.0, top_k=0, top_p=1.0,
                               seed=seed, stop=[], job=job, on_text=(lambda piece: None) if streamed else None)
        try:
            unit = next(work)
            while True:
                if unit.kind in ("prefill", "step"):
                    events.append(unit.kind)
                unit = work.send(m.run(unit.kind, [unit])[0])
        except StopIteration as stop:
            outs.append(stop.value)
        steps = events.count("step") + events.count("prefill")
        if streamed:  # pipelined: each step launched before the host reads the token before it (its input)
            assert events == ["prefill"] + ["step", "read"] * 11 + ["read"]
        else:
            assert events[:steps] == ["prefill"] + ["step"] * 11 and events[steps:] == ["read"] * 12
    assert outs[0]["ids"] == outs[1]["ids"] and outs[2]["ids"] == outs[3]["ids"] and outs[0]["ids"] != outs[2]["ids"]
    assert outs[0]["text"] == outs[1]["text"] and outs[2]["text"] == outs[3]["text"]
    assert outs[0]["logprobs"] == pytest.approx(outs[1]["logprobs"], abs=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True])
def test_on_cuda_the_captured_graphs_generate_what_the_eager_engine_generates(compile):
    """On a GPU: the steps replayed as CUDA graphs (each bucket captured once; compiled by inductor first with
    ``compile``) give the eager engine's tokens (greedy, seeded, penalised) with rows leaving and coming back and
    the ring outgrowing its first buffers, log-probs within float tolerance; one graph per bucket used (4, and 2
    while row 1 is away)."""
    model = perturbed_model().cuda()
    ctx = dict(segment_len=8, mem_len=8, same_length=False, clamp_len=0)
    eager = generate(Model(model, graphs="off", **ctx), 150, away=range(40, 60))
    captured_model = Model(model, graphs="auto", compile=compile, **ctx)
    assert "captured as CUDA graphs" in captured_model.steps
    captured = generate(captured_model, 150, away=range(40, 60))
    assert sorted(captured_model.slots.graphs.graphs) == [2, 4]
    assert captured[0] == eager[0]
    tol = dict(atol=1e-4, rtol=1e-4) if compile else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(captured[1], eager[1]):
        torch.testing.assert_close(a, b, **tol)
    for (mem_a, kv_a), (mem_b, kv_b) in zip(captured[2], eager[2]):
        torch.testing.assert_close(mem_a, mem_b, **tol)
        torch.testing.assert_close(kv_a, kv_b, **tol)


@pytest.mark.parametrize("graphs, line", [
    ("auto", "generation steps: eager, not captured (no CUDA device)"),
    ("on", "generation steps: the static-buffer decode step, not captured (no CUDA), one per batch bucket"),
])
def test_the_server_says_at_start_up_which_step_generates(tmp_path, caplog, graphs, line):
    from serve_util import loader, make_model_dir

    from txl.serve.config import ServeConfig
    from txl.serve.server import Server

    server = Server(ServeConfig(state_dir=str(tmp_path / "s"), segment_len=8, graphs=graphs),
                    loader(make_model_dir(tmp_path / "m")))
    with caplog.at_level("INFO", logger="txl.serve.server"):
        server.load_model()
    try:
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("generation steps")] == [line]
    finally:
        server.engine.stop(5)
