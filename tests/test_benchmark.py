"""The benchmark package: analytic FLOP counts checked by hand, the library's own training step, the NVIDIA
shape at a reduced size, the command-line checks, and the helper scripts end to end on the tiny shape."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import txl.train
from benchmarks import compare
from benchmarks import run as bench

ROOT = Path(__file__).resolve().parents[1]


def test_flops_per_token_base():
    shape = bench.SHAPES["base"]
    n = 12 * (4 * 512 * 512 + 2 * 512 * 2048)  # q, k, v, output; two feed-forward matrices
    s = 204 * 512  # the softmax over the 204 byte symbols
    attn = 12 * 3 * 2 * 512 * 512  # content, position, values: 2 (H D) K each, K = 256 + 256
    assert bench.matmul_params(shape) == n
    assert bench.softmax_params(shape) == s
    assert bench.flops_per_token(shape, "train") == 6 * (n + s) + 3 * attn
    assert bench.flops_per_token(shape, "eval") == 2 * (n + s) + attn


def test_nvidia_shape_counts_the_adaptive_softmax_by_zipf_shares_and_evaluates_longer():
    shape = bench.SHAPES["nvidia"]
    h = sum(1 / r for r in range(1, 267736))
    share = [sum(1 / r for r in range(lo + 1, hi + 1)) / h for lo, hi in ((20000, 40000), (40000, 200000),
                                                                            (200000, 267735))]
    # div_val 1: every cluster is d_model wide (no projections); the head scores 20,000 words and 3 clusters.
    expected = 20003 * 512 + share[0] * 20000 * 512 + share[1] * 160000 * 512 + share[2] * 67735 * 512
    assert bench.softmax_params(shape) == pytest.approx(expected, rel=1e-9)
    assert 0.78 < 1 - sum(share) < 0.82  # Zipf: ~80% of the tokens are in the 20,000-word shortlist
    ev = shape.for_phase("eval")
    assert (ev.tgt_len, ev.mem_len, ev.batch) == (64, 640, 32)
    n = 16 * (4 * 512 * 512 + 2 * 512 * 2048)
    assert bench.flops_per_token(shape, "eval") == pytest.approx(2 * (n + expected) + 16 * 3 * 2 * 512 * 704)


def test_resized_overrides_train_and_eval_alike():
    small = bench.SHAPES["nvidia"].resized(batch=2, tgt_len=8)
    assert (small.batch, small.tgt_len, small.mem_len) == (2, 8, 192)
    assert (small.for_phase("eval").batch, small.for_phase("eval").tgt_len, small.for_phase("eval").mem_len) == \
        (2, 8, 640)


def test_model_fields_override_every_shape_and_bad_ones_are_refused(capsys):
    shape = bench.SHAPES["tiny"].with_model({"dropout_impl": "torch", "attn_impl": "reference", "dropout": 0.2})
    compute = bench.compute_config(shape, recompute_attention=False)
    assert (compute.dropout_impl, compute.attn_impl, compute.recompute_attention) == ("torch", "reference", False)
    config = bench.model_config(shape)
    assert config.n_layer == bench.SHAPES["tiny"].n_layer and config.dropout == 0.2
    model = bench.build_model(shape)
    assert (model.config, model.compute) == (config, bench.compute_config(shape))
    for argv, match in ((["--compute.dropout_impl", "fastest"], "compute.dropout_impl='fastest' is not allowed"),
                        (["--model.attn_impl", "reference"], "model.attn_impl: it is compute.attn_impl now"),
                        (["--model.dropuot", "0.1"],
                         "unknown field model.dropuot (did you mean dropout?); valid model fields are")):
        with pytest.raises(SystemExit):  # were it accepted: one tiny step, not the whole default benchmark
            bench.main([*argv, "--shapes", "tiny", "--dtypes", "fp32", "--phases", "eval", "--steps", "1",
                        "--warmup", "0", "--lengths", "--out", "/nonexistent/never-written"])
        assert match in capsys.readouterr().err


def test_speedup_flop_ratio_grows_with_length():
    shape = bench.SHAPES["small"]
    ratios = [bench.speedup_flop_ratio(shape, length) for length in (128, 800, 3800)]
    assert ratios == sorted(ratios) and 300 < ratios[1] < 800  # the paper measured 363x at 800


def test_training_is_timed_through_the_trainers_own_step():
    assert bench.library_train_step is txl.train.train_step


def test_library_step_trains_and_carries_memory(one_thread):
    """Two benchmark steps on the tiny shape: the loss on a fixed batch goes down, memory is (B, M, d) per layer."""
    shape = bench.SHAPES["tiny"]
    torch.manual_seed(0)
    model = bench.build_model(shape, dropout=0.0).train()
    optimizer = bench.build_optimizer(model, bench.OptimConfig(lr=1e-2))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    (x, y), = bench.batches(shape, 1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(x, labels=y).loss.item()
    memories = bench.library_step(model, optimizer, scaler, x, y, [None], "fp32", bench.CPU, 0)
    with torch.no_grad():
        after = model(x, labels=y).loss.item()
    assert after < before
    assert [tuple(m.shape) for m in memories[0]] == [(2, 16, 64)] * shape.n_layer


def test_zipf_tokens_stay_in_the_vocabulary_and_favour_the_head():
    shape = bench.SHAPES["nvidia"].resized(batch=2, tgt_len=64)
    (x, y), = bench.batches(shape, 1, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (2, 64) and int(x.max()) < shape.vocab_size and int(x.min()) >= 0
    assert (x < 20000).float().mean() > 0.6
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the next tokens


@pytest.mark.slow  # a 16-layer model's evaluation (59 s loaded)
def test_nvidia_shape_evaluates_at_a_reduced_batch(one_thread):
    """The WikiText-103 base shape (16 layers, 267,735-word adaptive softmax) runs one evaluation segment."""
    shape = bench.SHAPES["nvidia"].resized(batch=1, tgt_len=2, mem_len=2)
    peak = bench.MatmulPeak(torch.float32, n=64)
    samples, _ = bench.worker_eval(shape.for_phase("eval"), "fp32", 0, 1, peak)
    assert len(samples) == 1 and samples[0]["step"] > 0 and samples[0]["peak"] > 0


def test_cuda_device_is_refused_in_one_line_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"--device cuda: CUDA is not available on this machine; run with --device"):
        bench.main(["--device", "cuda"])
    with pytest.raises(SystemExit, match=r"--dtypes tf32: tf32 needs --device cuda"):
        bench.main(["--dtypes", "tf32"])


@pytest.mark.slow  # a real subprocess
def test_run_as_a_module_times_the_tiny_shape(tmp_path):
    """python -m benchmarks.run end to end (its workers are `-m benchmarks.run` subprocesses), one step each."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--shapes", "tiny", "--dtypes", "fp32", "--phases",
                          "eval", "--warmup", "0", "--steps", "1", "--threads", "1", "--lengths", "--out",
                          str(tmp_path), "--compute.attn_impl", "reference"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["shape"], r["compile"], r["batch"]) for r in records] == [("eval", "tiny", False, 2)]
    assert records[0]["model"] == {"attn_impl": "reference"}  # --compute.FIELD reached the worker
    assert records[0]["tokens_per_s"] > 0 and "tiny     fp32  eager    eval" in out


def test_compare_pairs_phases_and_shows_the_spread():
    row = dict(shape="base", dtype="fp32", tokens_per_s=300.0, mfu=0.6, peak_rss_mb=2000.0)
    before = [dict(row, kind="train"), dict(kind="speedup", rows=[dict(length=128, xl_ms_per_token=0.2,
                                                                     vanilla_ms_per_token=15.0, speedup=75.0)])]
    after = [dict(row, kind="train", mfu=0.67, mfu_runs=[0.66, 0.67, 0.7], tokens_per_s=338.0, peak_rss_mb=1850.0),
             dict(row, kind="eval", mfu=0.8),
             dict(kind="speedup", rows=[dict(length=128, xl_ms_per_token=0.1, vanilla_ms_per_token=10.0, speedup=100.0,
                                             flop_ratio=98.0, paper=None)])]
    table = compare.phase_table(before, after).splitlines()
    assert table[2] == "| base | fp32 | train | 300 | 338 | 0.60 | 0.67 (0.66-0.70) | 2000 | 1850 |"
    assert table[3] == "| base | fp32 | eval |  | 300 |  | 0.80 |  | 2000 |"
    assert "| 128 | 0.200 | 15.0 | 75x | 0.100 | 10.0 | 100x | 98x |  |" in compare.speedup_table(before, after)


@pytest.mark.slow  # a real subprocess
def test_changes_measures_every_change_on_the_tiny_shape():
    """python -m benchmarks.changes end to end (its page-reuse workers are subprocesses): every change off and on."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.changes", "--shape", "tiny", "--threads", "1"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    record = json.loads(out.splitlines()[-1])
    assert record["kind"] == "changes" and len(record["ms"]) == 4  # --compile (minutes) adds a fifth
    assert all(v["off"] > 0 and v["on"] > 0 for v in record["ms"].values())


@pytest.mark.oracle
def test_oracle_benchmark_times_the_same_model_side_by_side():
    """benchmarks.oracle gives the oracle txl's weights and refuses to time two models that compute different
    numbers; one interleaved step of each is timed."""
    pytest.importorskip("transformers")
    from benchmarks import oracle

    ours, hf = oracle.build_pair(bench.SHAPES["tiny"])  # raises unless both give the same per-token NLL
    r = oracle.measure(bench.SHAPES["tiny"], "train", "fp32", warmup=0, steps=1)
    assert r["txl_step_s"] > 0 and r["oracle_step_s"] > 0 and r["speedup"] == r["oracle_step_s"] / r["txl_step_s"]
    assert r["txl_cpu_s"] > 0 and r["cpu_speedup"] == r["oracle_cpu_s"] / r["txl_cpu_s"]



def test_a_failed_worker_is_a_row_with_keep_going_and_stops_the_run_without(tmp_path, capsys):
    """--keep-going: a measurement over --worker-timeout is a 'failed' row naming why, written to results.jsonl as
    soon as it is known (a time-limited GPU session keeps what was measured); without it the run stops there."""
    tiny = ["--shapes", "tiny", "--dtypes", "fp32", "--phases", "eval", "--warmup", "0", "--steps", "1",
            "--threads", "1", "--lengths", "--worker-timeout", "0.01", "--out", str(tmp_path)]
    bench.main([*tiny, "--keep-going"])
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert (row["kind"], row["phase"], row["shape"], row["dtype"], row["failure"]) == \
        ("failed", "eval", "tiny", "fp32", "over --worker-timeout 0.01 s")
    assert "FAILED tiny fp32 eval (over --worker-timeout 0.01 s)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"benchmark worker failed \(over --worker-timeout 0.01 s\): .* --worker eval"):
        bench.main(tiny)


@pytest.mark.parametrize("option,message", [(["--steps", "0"], "--steps 0: give at least 1"),
                                            (["--worker-timeout", "-1"], "--worker-timeout -1: give a positive")])
def test_counts_that_measure_nothing_are_refused(option, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tiny", *option])
    assert message in capsys.readouterr().err


def test_serve_throughput_gives_the_server_one_thread_by_default():
    """The clients share the machine with the server: two forward threads on a shared 2-core machine ran 7x slower
    than one (OpenMP threads spinning for cores the clients hold), so one is the default and the docstring says so."""
    from benchmarks import serve_throughput

    assert serve_throughput.parser().parse_args([]).threads == serve_throughput.THREADS == 1
    assert "[--threads 1]" in serve_throughput.__doc__
    assert serve_throughput.parser().parse_args(["--threads", "4"]).threads == 4
