"""Recurrence end to end (experiments.recurrence): a tiny model trained 400 steps on one-key recall answers
from the memory what no query of its segment can see, and the same model trained without memory does not,
though it learned the task (it answers within the segment)."""

import json

import pytest

import experiments  # noqa: F401  (puts this checkout's src first on sys.path)
from experiments import recurrence


@pytest.mark.slow  # trains two models (31 s on a 2-core machine)
def test_the_memory_carries_the_answer_past_the_segment(capsys):
    assert recurrence.main(["--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    chance = out["chance"]
    assert out["passed"] is True and chance == 0.25
    with_memory, without = out["with_memory"], out["without_memory"]
    for model in (with_memory, without):  # the same held-out answers for both
        assert model["earlier_segment"]["answers"] > 150 and model["same_segment"]["answers"] > 150
    assert with_memory["earlier_segment"]["accuracy"] > 0.9  # recalled across the segment boundary
    assert without["same_segment"]["accuracy"] > chance + 0.25  # it learned the lookup ...
    assert without["earlier_segment"]["accuracy"] < chance + 0.1  # ... but cannot reach the earlier segment


def test_too_short_a_training_does_not_pass_and_bad_input_is_refused(capsys):
    assert recurrence.main(["--steps", "30", "--threads", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False
    with pytest.raises(SystemExit, match="at least 2"):
        recurrence.main(["--max-distance", "1"])
