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


def test_serve_reads_a_run_in_txl_scores_context(tmp_path, capsys):
    """One default context: on a training run, `txl serve` reads with the run's [eval] (tgt_len, mem_len,
    same_length, clamp_len), as `txl score` does, where no --serve option is given; an option given wins; a
    model without a run keeps the model's. The served document's NLL equals txl score's."""
    import json

    from test_generate_cli import _byte_checkpoint, run_cli

    from txl.cli import build_parser
    from txl.cli.serve import serve_config

    run = {"eval": {"tgt_len": 5, "mem_len": 3, "same_length": True, "clamp_len": 2}}
    ckpt, text = _byte_checkpoint(tmp_path, run)
    parse = build_parser().parse_args
    config = serve_config(parse(["serve", str(ckpt)]), ckpt)
    assert (config.segment_len, config.mem_len, config.same_length, config.clamp_len) == (5, 3, True, 2)
    given = serve_config(parse(["serve", str(ckpt), "--serve.mem_len", "4", "--serve.segment_len", "7"]), ckpt)
    assert (given.segment_len, given.mem_len, given.same_length) == (7, 4, True)
    (tmp_path / "plain").mkdir()
    plain, _ = _byte_checkpoint(tmp_path / "plain")
    assert serve_config(parse(["serve", str(plain)]), plain) == ServeConfig()

    rc, out, err = run_cli(capsys, "score", "--checkpoint", ckpt, "--totals-only", "-o", "-", text)
    assert rc == 0, err
    want = json.loads(out.splitlines()[0])
    server = Server(ServeConfig(state_dir=str(tmp_path / "state"), **{k: getattr(config, k) for k in (
        "segment_len", "mem_len", "same_length", "clamp_len")}), loader(ckpt))
    server.load_model()
    try:
        engine = server.engine
        from txl.serve.session import SessionState

        state = SessionState(id="", tokens=list(engine.context_ids))
        work = engine.read_text(state, text.read_text(), final=True)
        result = None
        try:
            unit = next(work)
            while True:
                unit = work.send(engine.m.run(unit.kind, [unit])[0])
        except StopIteration as stop:
            result = stop.value
        assert state.nll == pytest.approx(want["nll"], rel=1e-6) and len(result[1]) == want["tokens"]
    finally:
        engine.stop(5)
