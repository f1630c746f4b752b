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
