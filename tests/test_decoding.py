"""The one decoding core (``txl.decoding``) under `txl generate` and `txl serve`: served generation equals
txl.generate token for token (greedy and seeded, sessions and completions); a generation step grows memory
and keys in place (no torch.cat); rows come to the model's device and dtype (the meta device standing in
for CUDA); the stop-text matcher and the sampler, alone."""

import pytest
import torch
from conftest import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

import txl
from txl.decoding import Decoder, Picker, Rows, StopText
from txl.generation import FINISHED, generate_steps

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
PROMPT = "The cat sat on the mat. A dog"


# -- served generation equals the library's ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("fastapi")
    import httpx
    from serve_util import loader, make_model_dir, running

    from txl.serve import ServeConfig, create_app

    directory = make_model_dir(tmp_path_factory.mktemp("decoding") / "char")
    load = loader(directory)
    app = create_app(ServeConfig(state_dir=str(tmp_path_factory.mktemp("state")), durability="shutdown"), load)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        model, tok, _ = load()
        client.model, client.tok = model, tok
        yield client


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7),
                                      dict(temperature=0.8, top_k=5, top_p=0.9, seed=3),
                                      dict(temperature=0, repetition_penalty=5.0)])
def test_served_generation_equals_txl_generate(served, sampling):
    """POST /v1/sessions/{id}/generate and /v1/completions sample what txl.generate samples from the same
    tokens, token for token, with the same log-probabilities."""
    model, tok = served.model, served.tok
    context = [] if tok.context_id is None else [int(tok.context_id)]
    ids = context + [int(i) for i in tok.encode_prompt(PROMPT)]
    steps = list(generate_steps(model, ids, max_new_tokens=24, **sampling))
    want = [int(s.tokens[0]) for s in steps]
    want_lps = [float(s.logprobs[0]) for s in steps]
    if sampling.get("seed") is not None or "repetition_penalty" in sampling:
        assert len(set(want)) > 1  # a real continuation, not one token repeated

    sid = served.post("/v1/sessions").json()["id"]
    assert served.post(f"/v1/sessions/{sid}/text", json={"text": PROMPT}).status_code == 200
    r = served.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 24, "logprobs": True, **sampling})
    assert r.status_code == 200, r.text
    got = r.json()["logprobs"]
    assert [g["token"] for g in got] == [tok.token_text(t) for t in want]
    assert [g["logprob"] for g in got] == pytest.approx(want_lps, abs=1e-4)

    r = served.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "logprobs": 1, **sampling})
    assert r.status_code == 200, r.text
    block = r.json()["choices"][0]["logprobs"]
    assert block["tokens"] == [tok.token_text(t) for t in want]
    assert block["token_logprobs"] == pytest.approx(want_lps, abs=1e-4)
    assert r.json()["choices"][0]["text"] == tok.decode(want)


def test_served_stop_tokens_end_the_generation(served):
    model, tok = served.model, served.tok
    context = [] if tok.context_id is None else [int(tok.context_id)]
    ids = context + [int(i) for i in tok.encode_prompt(PROMPT)]
    free = txl.generate(model, ids, max_new_tokens=12, temperature=0)[0].tolist()
    stop = free[4]
    k = free.index(stop) + 1
    want = txl.generate(model, ids, max_new_tokens=12, temperature=0, stop_tokens=[stop])[0].tolist()
    assert want[:k] == free[:k] and set(want[k:]) <= {FINISHED}
    r = served.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                             "stop_token_ids": [stop], "logprobs": 0})
    out = r.json()["choices"][0]
    assert out["logprobs"]["tokens"] == [tok.token_text(t) for t in free[:k]] and out["finish_reason"] == "stop"
    r = served.post("/v1/completions", json={"prompt": PROMPT, "stop_token_ids": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "stop_token_ids"


# -- a step grows memory and keys in place ------------------------------------------------------------------------

class CatCounter(TorchDispatchMode):
    """The input shapes of every aten.cat a region calls."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[list[tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.cat:
            self.shapes.append([tuple(t.shape) for t in args[0]])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mem_len", [None, 9])
def test_a_generation_step_calls_no_cat_on_memory_or_keys(mem_len):
    """70 (B, 1) steps after a left-padded prefill (past a buffer's 64 spare rows; mem_len 9: a sliding window):
    no torch.cat takes a memory (B, M, d) or key/value (B, M, H, D) tensor; the buffer is replaced, not grown."""
    torch.manual_seed(0)
    c = tiny_config(vocab_size=50, n_layer=3)
    model = txl.TransformerXL(c).eval()
    decoder = Decoder(model, mem_len=mem_len)
    B = 3
    _, rows = decoder.run(torch.randint(0, 50, (B, 6)), None, lead=[0, 2, 5])
    counter = CatCounter()
    with counter:
        for _ in range(70):
            _, rows = decoder.run(torch.randint(0, 50, (B, 1)), rows)
    state = [s for shapes in counter.shapes for s in shapes
             if len(s) >= 3 and s[0] == B and s[-1] in (c.d_model, c.d_head)]
    assert state == []
    assert rows.length == (76 if mem_len is None else 9) and rows.buffers


class OpCounter(TorchDispatchMode):
    """The aten ops a region calls, by name (``aten.index``), and the input shapes of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket), [tuple(t.shape) for t in args if isinstance(t, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clamp_len", [0, 40])
def test_a_generation_step_reads_the_positional_table_as_a_view(monkeypatch, clamp_len):
    """70 (B, 1) steps of relative attention (the cache's W_kR R table doubles on the way; clamp_len 40 is reached
    at step 35): no layer gathers, flips or selects rows of the table while no distance is clamped (the table
    keeps the farthest first, so distances K-1 .. 0 are its last K rows), one gather per layer once clamped; the
    model reads its weights' version once a step (it walks every parameter); the log-probs are the uncached
    model's."""
    import txl.model.transformer as transformer
    from txl.model.kv_cache import weights_version

    torch.manual_seed(0)
    c = tiny_config(vocab_size=50, n_layer=3, clamp_len=clamp_len)
    model = txl.TransformerXL(c).eval()
    decoder = Decoder(model, check_weights=False)
    reads = []
    monkeypatch.setattr(transformer, "weights_version", lambda m: reads.append(1) or weights_version(m))
    prompt, ids = torch.randint(0, 50, (2, 6)), torch.randint(0, 50, (2, 70))
    lp, rows = decoder.run(prompt, None)
    gathers, table_rows = [], []
    for t in range(70):
        reads.clear()
        counter = OpCounter()
        with counter:
            lp, rows = decoder.run(ids[:, t:t + 1], rows)
        assert len(reads) == 1
        gathers.append(sum(1 for name, shapes in counter.calls
                           if name in ("aten.index", "aten.flip", "aten.index_select", "aten.gather")
                           and shapes[0][1:] == (c.n_head, c.d_head)))
        table_rows.append(decoder.table[0].size(0))
    # K - 1 = 6 + t is the farthest distance of step t: clamped from 41 on.
    assert gathers == [0 if clamp_len == 0 or 6 + t <= clamp_len else c.n_layer for t in range(70)]
    assert len(set(table_rows)) > 2  # the table grew on the way
    with torch.no_grad():  # the last step against the whole sequence read at once, no cache
        whole = model(torch.cat([prompt, ids], 1), context=decoder.context).log_probs[:, -1]  # (2, V)
    torch.testing.assert_close(lp, whole, atol=1e-5, rtol=1e-5)


def test_the_decoder_equals_the_model_alone_with_pads():
    """Decoder.run over a left-padded batch (prefill, then steps, then a subset, then rows of two batches
    gathered): each row's log-probs are its own, alone."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(vocab_size=50)).eval()
    decoder = Decoder(model)
    prompts = [torch.randint(0, 50, (n,)) for n in (5, 2, 4)]
    batch = torch.stack([torch.cat([torch.zeros(5 - len(p), dtype=torch.long), p]) for p in prompts])  # (3, 5)
    lp, rows = decoder.run(batch, None, lead=[5 - len(p) for p in prompts])
    alone = [decoder.run(p[None], None) for p in prompts]
    for b in range(3):
        torch.testing.assert_close(lp[b], alone[b][0][0], atol=1e-5, rtol=1e-5)
    step = torch.tensor([[7], [8], [9]])
    lp, rows = decoder.run(step, rows)
    alone = [decoder.run(step[b:b + 1], r) for b, (_, r) in enumerate(alone)]
    for b in range(3):
        torch.testing.assert_close(lp[b], alone[b][0][0], atol=1e-5, rtol=1e-5)
    sub = rows.select([0, 2])
    lp, _ = decoder.run(step[[0, 2]], sub)
    for i, b in enumerate([0, 2]):
        torch.testing.assert_close(lp[i], decoder.run(step[b:b + 1], alone[b][1])[0][0], atol=1e-5, rtol=1e-5)
    mixed = decoder.rows([rows.take(1), alone[2][1].take(0)])
    lp, _ = decoder.run(step[:2], mixed)
    torch.testing.assert_close(lp[0], decoder.run(step[:1], alone[1][1])[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp[1], decoder.run(step[1:2], alone[2][1])[0][0], atol=1e-5, rtol=1e-5)


# -- rows on the model's device ---------------------------------------------------------------------------------

class Stop(Exception):
    pass


def test_spilled_session_rows_come_to_the_models_device_and_dtype(tmp_path, monkeypatch):
    """A session written to disk and read back holds CPU float32 rows; served by a model on another device (the
    meta device stands in for CUDA) in bfloat16, every row the forward receives (memory, kept keys and values,
    padding) is on the model's device, in its dtype."""
    from txl.serve.engine import Model, Unit
    from txl.serve.session import SessionState

    c = tiny_config(vocab_size=50)
    state = SessionState(id="x" * 32, memory=torch.randn(c.n_layer, 5, c.d_model), tokens=[1, 2, 3])
    state.to_file(tmp_path / "s.safetensors")
    back = SessionState.from_file(tmp_path / "s.safetensors")
    assert back.memory.device.type == "cpu"
    model = txl.TransformerXL(c).to(device="meta", dtype=torch.bfloat16)
    m = Model(model, segment_len=8, mem_len=8, same_length=False, clamp_len=0)
    seen = []

    def forward(ids, **kw):
        seen.append([ids, kw["padding"], *kw["memory"], *(kw["kv_cache"].keys if kw["kv_cache"] else ())])
        raise Stop

    monkeypatch.setattr(model, "forward", forward)
    kv = (torch.randn(c.n_layer, 3, c.n_head, c.d_head), torch.randn(c.n_layer, 3, c.n_head, c.d_head))
    units = {"prefill": [Unit("prefill", back.tokens, back.memory), Unit("prefill", [4, 5, 6], None)],
             "step": [Unit("step", [3], back.memory, kv=kv), Unit("step", [4], back.memory[:, :3], kv=kv)]}
    kv = (kv[0][:, :3], kv[1][:, :3])
    units["step"][0] = Unit("step", [3], back.memory[:, :3], kv=kv)
    for kind, group in units.items():
        with pytest.raises(Stop):
            m.run(kind, group)
        tensors = [t for t in seen[-1] if t is not None]
        assert len(tensors) >= 2 + c.n_layer and all(t.device.type == "meta" for t in tensors), kind
        assert all(t.dtype == torch.bfloat16 for t in seen[-1][2:]), kind
    with pytest.raises(Stop):
        m.run("score", [Unit("score", [1, 2], back.memory, [2, 3])])
    assert all(t.device.type == "meta" and t.dtype == torch.bfloat16 for t in seen[-1][2:])


def test_rows_gather_left_pads_onto_the_device():
    rows = Rows.gather([(torch.ones(2, 3, 4), None), (None, None), (torch.ones(2, 1, 4), None)], cached=False,
                       device=torch.device("meta"), dtype=torch.float16)
    assert rows.pads == [0, 3, 2] and rows.memory[0].shape == (3, 3, 4)
    assert rows.memory[0].device.type == "meta" and rows.memory[0].dtype == torch.float16
    assert rows.padding(1, device=torch.device("cpu")).tolist() == [[False] * 4, [True] * 3 + [False],
                                                                    [True] * 2 + [False] * 2]


# -- the parts alone --------------------------------------------------------------------------------------------

def test_stop_text_holds_what_may_become_a_stop():
    s = StopText(["STOP", "xyz"])
    shown = []
    for piece in ["ab", "cS", "TO", "Pdef"]:
        if s.push(piece):
            break
        shown.append(s.show())
    assert shown == ["", "a", "bc"] and s.stopped and s.text == "abc"  # 3 characters held: 'STOP' less one
    assert s.finish() == ""
    t = StopText(["zz"])
    assert not t.push("hello z") and t.show() == "hello " and not t.push("y") and t.show() == "z"
    assert t.push("zz!") and t.text == "hello zy" and t.finish() == "y"
    assert StopText([]).push("anything") is False
    with pytest.raises(ValueError, match="empty"):
        StopText([""])


def test_picker_rows_have_their_own_seeds_and_penalty():
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 20), -1)
    a = Picker(temperature=1.0, seeds=[5, 6, 7], vocab_size=20, top_logprobs=2)(lp)
    alone = Picker(temperature=1.0, seeds=[6], vocab_size=20)(lp[1:2])
    assert int(a.tokens[1]) == int(alone.tokens[0])
    assert a.logprobs.tolist() == pytest.approx(lp.gather(1, a.tokens[:, None]).squeeze(1).tolist())
    assert [t for t, _ in a.top[0]] == lp[0].topk(2).indices.tolist()
    p = Picker(temperature=0, repetition_penalty=1e6, vocab_size=20, stop_tokens=[3])
    first = p(lp[:1])
    second = p(lp[:1])
    assert int(second.tokens[0]) != int(first.tokens[0])  # the token just drawn is penalised
    assert p(torch.log_softmax(torch.eye(20)[3:4] * 50, -1)).stopped.tolist() == [True]
    with pytest.raises(ValueError, match="stop_tokens"):
        Picker(temperature=0, vocab_size=20, stop_tokens=[20])
