"""A few seconds of `benchmarks.serve_load` against a real server: 8 clients mixing text, generation and
completions over 10 sessions with 3 in RAM (so sessions spill and come back under load): no errors, and
every session's totals equal a serial replay of its requests."""

import asyncio

import pytest

pytest.importorskip("fastapi")
from serve_util import TEXT, loader, make_model_dir, running  # noqa: E402

from benchmarks.serve_load import replay, run_load  # noqa: E402
from txl.serve import ServeConfig, create_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_load_loses_and_mixes_nothing(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    app = create_app(ServeConfig(state_dir=str(tmp_path / "state"), segment_len=16, max_sessions_in_memory=3,
                                 max_queue=1000), loader(model_dir))
    with running(app) as url:
        res = asyncio.run(run_load(url, clients=8, seconds=3, sessions=10, text=TEXT * 4, max_tokens=6))
        assert res["errors"] == 0, res["error_samples"]
        assert res["requests"] >= 20
        assert app.state.server.engine.store.evictions > 0
        assert asyncio.run(replay(url, res["logs"], res["finals"])) == []
