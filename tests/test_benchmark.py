"""The benchmark's analytic FLOP counts, checked by hand for the base shape."""

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/run.py as a module; its sys.path entry and module registration are undone afterwards."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("txl_benchmark_run", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_flops_per_token_base(bench):
    shape = bench.SHAPES["base"]
    n = 12 * (4 * 512 * 512 + 2 * 512 * 2048)  # q, k, v, output; two feed-forward matrices
    attn = 12 * 3 * 2 * 512 * 512  # content, position, values: 2 (H D) K each, K = 256 + 256
    assert bench.matmul_params(shape) == n
    assert bench.flops_per_token(shape, "train") == 6 * n + 3 * attn
    assert bench.flops_per_token(shape, "eval") == 2 * n + attn


def test_speedup_flop_ratio_grows_with_length(bench):
    shape = bench.SHAPES["small"]
    ratios = [bench.speedup_flop_ratio(shape, length) for length in (128, 800, 3800)]
    assert ratios == sorted(ratios) and 300 < ratios[1] < 800  # the paper measured 363x at 800


def test_compare_pairs_phases_and_shows_the_spread():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"
    spec = importlib.util.spec_from_file_location("txl_benchmark_compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
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


def test_changes_measures_every_change_on_the_tiny_shape():
    """benchmarks/changes.py end to end (its page-reuse workers are subprocesses): every change timed off and on."""
    import json
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "changes.py"
    out = subprocess.run([sys.executable, str(script), "--shape", "tiny", "--threads", "1"], check=True,
                         capture_output=True, text=True).stdout
    record = json.loads(out.splitlines()[-1])
    assert record["kind"] == "changes" and len(record["ms"]) == 4  # --compile (minutes) adds a fifth
    assert all(v["off"] > 0 and v["on"] > 0 for v in record["ms"].values())
