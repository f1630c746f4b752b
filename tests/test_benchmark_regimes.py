"""Issue 34's honest benchmarks: evaluation is timed at a full memory only; CUDA's default shapes keep a GPU busy;
the speed-up table states its regime and writes outside the committed results; the graphs mode and the
before/after switches of one change run inside one benchmark worker."""

import json

import pytest
import torch

from benchmarks import run as bench
from benchmarks import switches
from experiments import common, speedup
from txl.model import kernels

pytestmark = pytest.mark.usefixtures("one_thread")


def test_evaluation_is_timed_only_at_a_full_memory(monkeypatch):
    """T 4 against M 10: three segments fill the memory; the warm-up of 0 asked for becomes 4 (full, and once
    more at that shape), and every timed segment reads 10 memory rows."""
    shape = bench.SHAPES["tiny"].resized(batch=1, tgt_len=4, mem_len=10)
    lengths, real = [], bench.txl.TransformerXL.forward

    def spy(self, input_ids, labels=None, memory=None, **kw):
        lengths.append(0 if memory is None else memory[0].size(1))
        return real(self, input_ids, labels, memory, **kw)

    monkeypatch.setattr(bench.txl.TransformerXL, "forward", spy)
    samples, extra = bench.worker_eval(shape, "fp32", 0, 3, bench.MatmulPeak(torch.float32, n=32))
    assert bench.eval_fill_segments(shape) == 3 and extra["warmup"] == 4 and extra["timed_mem_len"] == 10
    assert lengths == [0, 4, 8, 10, 10, 10, 10] and len(samples) == 3


def test_a_timed_segment_short_of_memory_fails_loudly(monkeypatch):
    """Were the warm-up to stop before the memory is full, the benchmark raises instead of timing it."""
    shape = bench.SHAPES["tiny"].resized(batch=1, tgt_len=4, mem_len=10)
    monkeypatch.setattr(bench, "eval_fill_segments", lambda shape: 0)
    with pytest.raises(AssertionError, match="timed segment 0 read 4 memory rows, not the evaluation's mem_len 10"):
        bench.worker_eval(shape, "fp32", 0, 2, bench.MatmulPeak(torch.float32, n=32))


def test_cuda_defaults_to_gpu_sized_shapes():
    """base-gpu is base at B 32, T = M = 512; every CUDA default shape but NVIDIA's own geometry (kept for their
    published figures) feeds >= 8,192 tokens a step."""
    base, gpu = bench.SHAPES["base"], bench.SHAPES["base-gpu"]
    assert (gpu.n_layer, gpu.d_model, gpu.n_head, gpu.d_inner) == (base.n_layer, base.d_model, base.n_head,
                                                                    base.d_inner)
    assert (gpu.batch, gpu.tgt_len, gpu.mem_len) == (32, 512, 512)
    for name in bench.GPU_SHAPES:
        if name != "nvidia":
            shape = bench.SHAPES[name]
            assert shape.batch * shape.tgt_len >= 8192, name
            ev = shape.for_phase("eval")
            assert ev.batch * ev.tgt_len >= 8192, name


def test_the_speedup_table_states_its_regime_and_stays_out_of_docs(tmp_path):
    assert speedup.DEFAULT_RESULTS != common.RESULTS_DIR and "runs" in speedup.DEFAULT_RESULTS.parts
    assert speedup.main(["--results", str(tmp_path), "--shape", "tiny", "--lengths", "8,20", "--reps", "3"]) == 0
    payload = json.loads((tmp_path / "speedup.json").read_text())
    md = (tmp_path / "speedup.md").read_text()
    for words in ("tiny widths (2 layers, d_model 64", "batch 1, fp32", "T = M = L", "T = 128 (L if shorter), M = L",
                  "last position scored", "warmed up (2 repetitions), then 3 timed", "spread"):
        assert words in payload["regime"] and words in md, words
    for row in payload["rows"]:
        assert row["reps"] == 3 and row["short_tgt_len"] == min(128, row["length"])
        assert set(row["spread"]) == {"xl", "xl_short", "vanilla"} and all(v >= 0 for v in row["spread"].values())
        assert row["speedup"] > 0 and row["speedup_short"] > 0


def test_the_vanilla_side_scores_only_its_last_position(monkeypatch):
    """The vanilla model's softmax sees one position per window; XL's all T of its segment."""
    sizes, real = [], bench.txl.model.adaptive.AdaptiveLogSoftmax.log_prob

    def spy(self, hidden):
        sizes.append(hidden.size(0))
        return real(self, hidden)

    monkeypatch.setattr(bench.txl.model.adaptive.AdaptiveLogSoftmax, "log_prob", spy)
    bench.worker_speedup(bench.SHAPES["tiny"], [6], reps=1)
    n = bench.SPEEDUP_WARMUP + 1
    assert sizes == [6] + [6, 6, 1] * n  # the first segment, then per repetition: XL, XL (T = 6), vanilla


def test_a_switch_puts_the_earlier_code_back_inside_its_block_only():
    pinned = kernels.sdpa
    with switches.before(["sdpa-pin"]):
        assert kernels.sdpa is not pinned
        q = torch.randn(1, 2, 3, 4, device="meta")
        seen = []
        real = torch.nn.functional.scaled_dot_product_attention
        try:
            torch.nn.functional.scaled_dot_product_attention = (
                lambda *a, **k: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or real(*a, **k))
            kernels.sdpa(q, q, q, torch.zeros(3, 3, device="meta"))
        finally:
            torch.nn.functional.scaled_dot_product_attention = real
        assert seen == [torch.backends.cuda.cudnn_sdp_enabled()]  # the flags as they are: nothing pinned
    assert kernels.sdpa is pinned
    assert switches.model_fields(["sdpa-pin"]) == {}


@pytest.mark.slow  # benchmark workers (34 s loaded)
def test_the_benchmark_runs_graphs_and_a_switch_side_by_side(tmp_path, capsys):
    """The driver end to end on the tiny shape: eager and graphs (aot_eager, over rings), with and without the SDPA
    pin."""
    bench.main(["--shapes", "tiny", "--dtypes", "fp32", "--phases", "eval", "--modes", "eager", "graphs",
                "--graphs-backend", "aot_eager", "--steps", "1", "--warmup", "0", "--lengths", "--threads", "1",
                "--out", str(tmp_path), "--before", "sdpa-pin"])
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["graphs"], r["before"]) for r in rows] == [(False, ["sdpa-pin"]), (True, ["sdpa-pin"])]
    assert all(r["timed_mem_len"] == 16 and r["warmup"] == 2 for r in rows)
    assert rows[1]["rings"] is True  # the graphs row evaluates over key/value rings (txl.static_eval)
    out = capsys.readouterr().out
    assert "tiny fp32 eval: graphs / eager tokens/s = " in out and "before: sdpa-pin" in out


def test_the_flex_benchmark_compares_both_kernels_on_the_same_operands(capsys):
    """benchmarks.flex on a CPU (forward, FlexAttention unfused): both sides agree, both are timed."""
    from benchmarks import flex

    assert flex.main(["--smoke", "--reps", "2", "--warmup", "0"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == ["train", "eval"]
    for r in rows:
        assert r["max_abs_diff"] < 1e-5 and r["sdpa_ms"] > 0 and r["flex_ms"] > 0 and r["backward"] is False


def test_every_switch_this_txl_has_builds_its_before_model_and_others_are_refused(monkeypatch):
    for name in switches.available():
        model = bench.build_model(bench.SHAPES["tiny"], **switches.model_fields([name]))
        for field, value in switches.SWITCHES[name].model.items():
            assert getattr(model.compute, field, getattr(model.config, field, None)) == value
    monkeypatch.setitem(switches.SWITCHES, "fake", switches.Switch("x", model={"no_such_field": 1}))
    assert "fake" not in switches.available() and "sdpa-pin" in switches.available()
    with pytest.raises(SystemExit, match="--before fake: this txl's ModelConfig and ComputeConfig lack no_such_field"):
        switches.model_fields(["fake"])


def test_a_profile_that_fails_loses_the_profile_not_the_row():
    def broken():
        raise RuntimeError("the profiler cannot trace a replayed graph")

    assert bench.profiled(torch.device("cpu"), broken) == {
        "profile_error": "the profiler cannot trace a replayed graph"}
    good = bench.profiled(torch.device("cpu"), lambda: torch.ones(64, 64) @ torch.ones(64, 64))
    assert good["profile_host_ms"] > 0 and good["profile_device_ms"] == 0.0 and "aten::mm" in good["profile"]
