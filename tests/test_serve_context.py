"""`txl serve` reads in the context of the one rule every command applies (``EvalConfig.context``): a field
left unset is the model's, a field set wins."""

import pytest

pytest.importorskip("fastapi")

from serve_util import loader, make_model_dir  # noqa: E402

from txl.config import EvalConfig  # noqa: E402
from txl.serve.app import Server  # noqa: E402
from txl.serve.config import ServeConfig  # noqa: E402


@pytest.mark.parametrize("fields", [dict(), dict(mem_len=3, same_length=False, clamp_len=0)])
def test_serve_context_is_the_models_where_unset(tmp_path, fields):
    directory = make_model_dir(tmp_path / "model", same_length=True, clamp_len=5)  # mem_len 8
    server = Server(ServeConfig(state_dir=str(tmp_path / "state"), **fields), loader(directory))
    server.load_model()
    assert not server.failed
    try:
        m = server.engine.m
        model = m.model.config
        want = EvalConfig(**fields).context(model)
        assert (m.mem_len, m.read_ctx.mem_len, m.read_ctx.same_length, m.read_ctx.clamp_len) == (
            want.mem_len, want.mem_len, want.same_length, want.clamp_len)
        assert (want.mem_len, want.same_length, want.clamp_len) == (
            (8, True, 5) if not fields else (3, False, 0))
    finally:
        server.engine.stop(5)
