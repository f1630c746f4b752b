"""The compiled generation step (``txl.compiled_step``, ``Decoder(compile=True)``) equals the eager step, greedy token
for token and in log-probabilities, and one graph serves every step while the memory grows, slides and moves to a new
buffer, and while rows leave the batch.

The graph counts come from a counting torch.compile backend wrapped around ``aot_eager`` (the graphs dynamo and
AOTAutograd make, without inductor's code generation, which takes tens of seconds here); one slow test runs inductor.
"""

import pytest
import torch
from conftest import Counting, perturbed_model

from txl.compiled_step import HEADROOM, CompiledStep, compiled_step_error
from txl.decoding import Decoder
from txl.serve.engine import Model

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

STEPS = HEADROOM + 6  # the rows move to a new buffer on the way
LEAD = [0, 2, 4]  # a left-padded prompt batch: rows of 7, 5 and 3 tokens


def greedy(decoder: Decoder, steps: int = STEPS, leave_at: int | None = None) -> tuple[torch.Tensor, list]:
    """Log-probabilities ((steps + 1) x (B, V)) and tokens of a greedy generation from a left-padded prompt;
    ``leave_at``: after that step the middle row leaves the batch (``Rows.select``)."""
    ids = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(1))  # (B, T)
    lp, rows = decoder.run(ids, None, lead=LEAD)
    log_probs, tokens = [lp], []
    for s in range(steps):
        if s == leave_at:
            rows, lp = rows.select([0, 2]), lp[[0, 2]]
        tok = lp.argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(tok.squeeze(1).tolist())
        lp, rows = decoder.run(tok, rows)
        log_probs.append(lp)
    return log_probs, tokens


@pytest.mark.slow  # torch.compile, three graphs (7-20 s each loaded)
@pytest.mark.parametrize("mem_len, clamp_len, overrides, leave_at, graphs", [
    # the memory keeps every row; from step 14 on (K = 22) distances beyond 20 share a row: the table, read as a
    # view until then, is gathered by clamped distance, a second graph
    (None, 20, {}, None, 2),
    (9, 5, {}, None, 1),  # a sliding window of 9 rows (its start moves along the buffer), clamped from the start
    (None, 0, {"pre_ln": True, "untie_r": True}, 10, 1),  # keys of normalised rows, each layer its own u, v; a row
    # leaves the batch after 10 steps (batch 3, then 2: the batch size is a symbol too)
], ids=["all_clamped_later", "window_clamp", "pre_ln_untied_leave"])
def test_compiled_steps_equal_eager_in_one_graph(mem_len, clamp_len, overrides, leave_at, graphs):
    model = perturbed_model(clamp_len=clamp_len, **overrides)
    backend = Counting()
    compiled = Decoder(model, mem_len=mem_len, compile=True, backend=backend)
    assert compiled.compiled is not None
    got, got_tokens = greedy(compiled, leave_at=leave_at)
    want, want_tokens = greedy(Decoder(model, mem_len=mem_len), leave_at=leave_at)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert backend.runs == STEPS  # every step ran the graph (the prefill runs eagerly)
    assert backend.graphs == graphs  # one graph served all of them (two across the clamp): none as the memory grows


@pytest.mark.slow  # torch.compile (16 s loaded)
def test_the_compiled_step_writes_into_the_rows_buffers():
    """The memory, keys and values the step returns are views of buffers it wrote in place: no per-token copy."""
    model = perturbed_model()
    decoder = Decoder(model, compile=True, backend=Counting())
    ids = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(2))  # (B, T)
    lp, rows = decoder.run(ids)
    _, after = decoder.run(lp.argmax(-1, keepdim=True), rows)
    _, later = decoder.run(lp.argmax(-1, keepdim=True), after)
    for before, now in ((after.memory, later.memory), (after.keys, later.keys), (after.values, later.values)):
        for b, n in zip(before, now):
            assert n.data_ptr() == b.data_ptr() and n.size(1) == b.size(1) + 1  # the same rows, one more
    uncached = model(torch.cat([ids, lp.argmax(-1, keepdim=True).expand(2, 2)], 1)).memory  # (B, 6, d) each
    for m, u in zip(later.memory, uncached):
        torch.testing.assert_close(m, u, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [dict(attn_type="absolute"), dict(attn_type="shaw"), dict(attn_type="rotary"),
                                       dict(cmem_len=4)], ids=["absolute", "shaw", "rotary", "compressive"])
def test_other_encodings_compile_the_whole_forward(overrides):
    model = perturbed_model(**overrides)
    why = compiled_step_error(model)
    assert why is not None and why.split("=")[0] in ("attn_type", "cmem_len")
    with pytest.raises(ValueError, match="a compiled generation step is not available: .*generate without compile"):
        CompiledStep(model)
    decoder = Decoder(model, compile=True)
    assert decoder.compiled is None and decoder.forward is not model  # torch.compile of the forward, as before


def test_the_serving_engine_passes_compile_on():
    model = perturbed_model()
    assert Model(model, segment_len=8, compile=True).decoder.compiled is not None
    assert Model(model, segment_len=8).decoder.compiled is None
    with pytest.raises(ValueError, match=r"serve.compile: attn_type='absolute': .* without --serve.compile"):
        Model(perturbed_model(attn_type="absolute"), segment_len=8, compile=True)  # refused at start


@pytest.mark.slow
def test_inductor_steps_equal_eager():
    """Inductor's generated code (the path `txl serve --serve.compile true` runs): greedy tokens identical, log-probs
    within 1e-4 (its fused loops sum in another order), one graph for the batch of 3 across the new buffer."""
    model = perturbed_model(clamp_len=5)
    backend = Counting("inductor")
    got, got_tokens = greedy(Decoder(model, mem_len=9, compile=True, backend=backend))
    want, want_tokens = greedy(Decoder(model, mem_len=9))
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert (backend.graphs, backend.runs) == (1, STEPS)


@pytest.mark.slow
def test_a_compiled_server_generates_what_txl_generate_does(tmp_path):
    """`txl serve --serve.compile true`: three prompts of one completion request, read and stepped as one batch
    through the compiled step (inductor), each continue as txl.generate (eager) continues it alone."""
    pytest.importorskip("fastapi")
    import httpx
    from serve_util import loader, make_model_dir, running

    from txl.generation import generate_steps
    from txl.serve import ServeConfig, create_app

    load = loader(make_model_dir(tmp_path / "char"))
    prompts = ["The cat sat on the mat. A dog", "it was big", "Café, naïve and (x + y)"]
    app = create_app(ServeConfig(state_dir=str(tmp_path / "state"), durability="shutdown", compile=True), load)
    with running(app) as url, httpx.Client(base_url=url, timeout=600) as client:
        r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 20, "temperature": 0,
                                                 "logprobs": 0})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        model, tok, _ = load()
    for prompt, choice in zip(prompts, choices):
        context = [] if tok.context_id is None else [int(tok.context_id)]
        steps = list(generate_steps(model, context + [int(i) for i in tok.encode_prompt(prompt)], max_new_tokens=20,
                                    temperature=0))
        assert choice["logprobs"]["tokens"] == [tok.token_text(int(s.tokens[0])) for s in steps]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx([float(s.logprobs[0]) for s in steps], abs=1e-4)
