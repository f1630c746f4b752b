import math

import numpy as np
import pytest

from txl.recl import group_baseline, hard_positions, recl, recl_details, relative_gain

GRID = list(range(100, 1001, 100))


def curve(base: np.ndarray, drop_per_100: float, stops_at: int) -> dict[int, np.ndarray]:
    """Per-position losses that fall by ``drop_per_100`` per 100 tokens of context up to ``stops_at``."""
    return {c: base - drop_per_100 * (min(c, stops_at) - 100) / 100 for c in GRID}


def test_model_that_stops_improving_has_shorter_recl():
    base = np.linspace(3.0, 6.0, 20)
    losses = {"short": curve(base, 0.3, 200), "long": curve(base, 0.3, 800)}
    assert recl(losses, GRID) == {"short": 200, "long": 800}
    details = recl_details(losses, GRID)
    assert not details["long"].saturated
    # The path of "long": 7 steps above threshold (100->800), then zero gain 800->900.
    assert [step[:2] for step in details["long"].gains][-1] == (800, 900)
    assert details["long"].gains[-1][2] == 0.0
    assert details["long"].gains[0][2] == pytest.approx(1 - math.exp(-0.3))


def test_group_relative_baseline():
    # "weak" improves steadily up to 800 but never gets below what "strong" already achieves at
    # any context: in the group its long context buys nothing over the shared baseline.
    strong = {c: np.full(10, 2.0) for c in GRID}
    weak = curve(np.full(10, 5.0), 0.3, 800)  # reaches 5.0 - 2.1 = 2.9 > 2.0
    assert recl({"strong": strong, "weak": weak}, GRID) == {"strong": 100, "weak": 100}
    # Measured alone, the same model has RECL 800.
    assert recl({"weak": weak}, GRID) == {"weak": 800}


def test_only_improvements_below_the_baseline_count():
    # At c=100 model a is best on position 0, b on position 1.
    a = {100: np.array([1.0, 3.0]), 200: np.array([0.5, 2.9])}
    b = {100: np.array([2.0, 2.0]), 200: np.array([1.0, 1.5])}
    group = {"a": a, "b": b}
    baseline = group_baseline(group, 100)
    np.testing.assert_array_equal(baseline, [1.0, 2.0])
    # a: min(b, l_a(200)) = [0.5, 2.0]; b: min(b, l_b(200)) = [1.0, 1.5]
    assert relative_gain(group, "a", 100, 200) == pytest.approx(1 - math.exp(0.5 * (0.5 + 2.0) - 1.5))
    assert relative_gain(group, "b", 100, 200) == pytest.approx(1 - math.exp(0.5 * (1.0 + 1.5) - 1.5))
    # Same short context on both sides: no gain by definition.
    assert relative_gain(group, "a", 100, 100) == 0.0


def test_r_selects_the_hardest_positions():
    # Nine easy positions improve up to 200; one hard position improves slowly up to 800.
    base = np.array([6.0] + [3.0] * 9)
    easy = curve(base, 0.3, 200)
    hard = curve(base, 0.08, 800)
    losses = {"m": {c: np.concatenate([hard[c][:1], easy[c][1:]]) for c in GRID}}
    assert recl(losses, GRID, r=0.1) == {"m": 800}  # T = {hard position}: gain 1 - e^-0.08
    assert recl(losses, GRID, r=0.5) == {"m": 800}  # 5 positions: mean drop 0.016 > 0.01
    assert recl(losses, GRID, r=1.0) == {"m": 200}  # 10 positions: mean drop 0.008 < 0.01


def test_hard_positions_use_the_group_minimum():
    # Position 0 is hard only for "bad"; the best model finds it easy, so it is not selected.
    group = {
        "bad": {100: np.array([9.0, 4.0, 1.0, 3.0])},
        "good": {100: np.array([0.5, 4.0, 1.0, 3.0])},
    }
    b = group_baseline(group, 100)
    np.testing.assert_array_equal(hard_positions(b, 0.5), [1, 3])
    np.testing.assert_array_equal(hard_positions(b, 0.25), [1])
    np.testing.assert_array_equal(hard_positions(b, 1.0), [0, 1, 2, 3])


def test_hard_positions_count_and_ties():
    assert len(hard_positions(np.arange(30.0), 0.1)) == 3  # 0.1 * 30 is not rounded up to 4
    assert len(hard_positions(np.arange(7.0), 0.1)) == 1  # ceil, at least one position
    np.testing.assert_array_equal(hard_positions(np.array([1.0, 2.0, 2.0, 2.0]), 0.5), [1, 2])


def test_threshold_and_saturation():
    losses = {"m": curve(np.full(5, 4.0), 0.02, 1000)}  # gain ~0.0198 on every step
    result = recl_details(losses, GRID)["m"]
    assert result.recl == 1000 and result.saturated
    assert recl(losses, GRID, threshold=0.03) == {"m": 100}


def test_step_and_start():
    losses = {"m": curve(np.full(5, 4.0), 0.3, 500)}
    assert recl(losses, GRID, step=200) == {"m": 500}  # 100 -> 300 -> 500 -> 700: no gain
    assert recl(losses, GRID, start=300) == {"m": 500}
    assert recl(losses, GRID, start=600) == {"m": 600}
    with pytest.raises(ValueError, match="lacks 300"):
        recl({"m": {**losses["m"], 250: losses["m"][200]}}, [100, 200, 250, 400], step=100)
    with pytest.raises(ValueError, match="start"):
        recl(losses, GRID, start=150)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"r": 0.0}, "r="), ({"r": 1.5}, "r="), ({"threshold": 0.0}, "threshold"), ({"step": 0}, "step")],
)
def test_parameter_validation(kwargs, match):
    losses = {"m": curve(np.full(3, 4.0), 0.1, 300)}
    with pytest.raises(ValueError, match=match):
        recl(losses, GRID, **kwargs)


def test_input_validation():
    good = curve(np.full(3, 4.0), 0.1, 300)
    with pytest.raises(ValueError, match="strictly increasing"):
        recl({"m": good}, [200, 100])
    with pytest.raises(ValueError, match="at least two"):
        recl({"m": good}, [100])
    with pytest.raises(ValueError, match="no losses for context lengths"):
        recl({"m": {100: good[100]}}, GRID)
    with pytest.raises(ValueError, match="same positions"):
        recl({"m": good, "n": curve(np.full(4, 4.0), 0.1, 300)}, GRID)
    with pytest.raises(ValueError, match="NaN"):
        recl({"m": {**good, 200: np.array([1.0, np.nan, 1.0])}}, GRID)
    with pytest.raises(ValueError, match="non-empty mapping"):
        recl({}, GRID)
