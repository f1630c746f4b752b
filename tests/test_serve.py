"""`txl serve` against a real uvicorn on 127.0.0.1: chunking is invisible (equal to `txl score`), batched rows
equal rows alone, one session's requests never interleave, spill and restore, TTL, keys, the OpenAI client."""

import concurrent.futures as futures
import json
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import TEXT, loader, make_model_dir, running, txl_score_logprobs  # noqa: E402

import txl  # noqa: E402
from txl.cli import main  # noqa: E402
from txl.serve import ServeConfig, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
SEGMENT = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("serve") / "char")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """One server for the module: segments of 16 tokens, memory 8, two sessions in RAM (so tests spill);
    sessions written on eviction only (test_serve_process.py tests the durable default)."""
    state = tmp_path_factory.mktemp("state")
    app = create_app(ServeConfig(state_dir=str(state), segment_len=SEGMENT, max_sessions_in_memory=2,
                                 max_text_chars=4096, max_tokens=64, max_body_bytes=16384, durability="shutdown"),
                     loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        client.state_dir = state
        yield client


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory):
    """`txl score`'s per-token log-probs of TEXT (the JSONL of the command, 6 decimals)."""
    return txl_score_logprobs(model_dir, tmp_path_factory.mktemp("score"), SEGMENT)


def new_session(client, **body):
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def read(client, sid, pieces, *, raw=False):
    """Send ``pieces`` in order, then end the document; the scored tokens' log-probs, concatenated."""
    lps = []
    for piece in pieces:
        if raw:
            r = client.post(f"/v1/sessions/{sid}/text", content=piece, params={"logprobs": "true"},
                            headers={"content-type": "application/octet-stream"})
        else:
            r = client.post(f"/v1/sessions/{sid}/text", json={"text": piece, "logprobs": True})
        assert r.status_code == 200, r.text
        lps += [t["logprob"] for t in r.json()["logprobs"] if t["logprob"] is not None]
    r = client.post(f"/v1/sessions/{sid}/text", json={"text": "", "final": True, "logprobs": True})
    assert r.status_code == 200, r.text
    return np.array(lps + [t["logprob"] for t in r.json()["logprobs"] if t["logprob"] is not None])


def cut(data, n):
    return [data[i:i + n] for i in range(0, len(data), n)]


@pytest.mark.parametrize("pieces", ["whole", "7 chars", "1 char", "5 bytes (UTF-8 cut)"])
def test_chunking_is_invisible(server, expected, pieces):
    """Any cut of the document gives `txl score`'s per-token log-probs on the whole (1e-5), every character scored
    (read after the line break, the char model's context token)."""
    raw = pieces.startswith("5 bytes")
    data = {"whole": [TEXT], "7 chars": cut(TEXT, 7), "1 char": list(TEXT[:100]) + [TEXT[100:]],
            "5 bytes (UTF-8 cut)": cut(TEXT.encode("utf-8")[:200], 5) + [TEXT.encode("utf-8")[200:]]}[pieces]
    if raw:  # some cuts do fall inside a multi-byte character
        assert any(not (p[:1][0] & 0xC0 != 0x80) for p in data[1:])
    got = read(server, new_session(server), data, raw=raw)
    assert len(got) == len(expected) == len(TEXT)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_line_tokenizer_carries_the_unfinished_word(tmp_path):
    """A word-level model: pieces cut mid-word equal the whole document (the line is held until it ends)."""
    directory = make_model_dir(tmp_path / "word", level="word")
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    out = tmp_path / "s.jsonl"
    assert main(["score", "--checkpoint", str(directory), str(doc), "-o", str(out), "--segment-len", "8"]) == 0
    want = [json.loads(line)["logprob"] for line in out.read_text().splitlines() if '"logprob"' in line]
    app = create_app(ServeConfig(state_dir=str(tmp_path / "state"), segment_len=8), loader(directory))
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        got = read(client, new_session(client), cut(TEXT, 7))
        whole = read(client, new_session(client), [TEXT])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(whole, want, atol=1e-5, rtol=0)


def test_batched_rows_equal_rows_alone(model_dir):
    """Rows with memories of different lengths read as one batch compute what each computes alone; so do
    generation steps on a kept batch, on a subset of it (a generation ended) and on rows of two batches."""
    from txl.serve.engine import Model, Unit

    m = Model(txl.from_pretrained(model_dir), segment_len=5, mem_len=8, same_length=True, clamp_len=0)
    g = torch.Generator().manual_seed(0)
    V = m.model.config.vocab_size
    ids = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(3)]
    memories = [None, torch.randn(2, 3, 32, generator=g), torch.randn(2, 8, 32, generator=g)]
    score = [Unit("score", x[:5], mem, x[1:]) for x, mem in zip(ids, memories)]
    for u, t in zip(score, m.run("score", score)):
        [alone] = m.run("score", [u])
        np.testing.assert_allclose(t.logprobs, alone.logprobs, atol=1e-5)
        torch.testing.assert_close(t.memory, alone.memory, atol=1e-5, rtol=1e-5)

    def same(batched, alone):
        torch.testing.assert_close(batched.next_log_probs, alone.next_log_probs, atol=1e-5, rtol=1e-5)
        for x, y in zip(batched.row[0].take(batched.row[1]), alone.row[0].take(alone.row[1])):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)

    together = m.run("prefill", [Unit("prefill", x[:5], mem) for x, mem in zip(ids, memories)])
    alone = [m.run("prefill", [Unit("prefill", x[:5], mem)])[0] for x, mem in zip(ids, memories)]
    for t, a in zip(together, alone):
        same(t, a)
    for step in range(3):  # the whole batch twice (its tensors as they are), then rows 0 and 2 (a subset)
        keep = [0, 1, 2] if step < 2 else [0, 2]
        together = m.run("step", [Unit("step", [step + 1], row=together[b].row) for b in keep])
        alone = [m.run("step", [Unit("step", [step + 1], row=alone[b].row)])[0] for b in keep]
        assert together[0].row[0].size == len(keep)
        for t, a in zip(together, alone):
            same(t, a)
    other = m.run("prefill", [Unit("prefill", ids[1][:3], memories[2])])  # a generation joining: gathered
    mixed = m.run("step", [Unit("step", [4], row=together[1].row), Unit("step", [5], row=other[0].row)])
    same(mixed[0], m.run("step", [Unit("step", [4], row=alone[1].row)])[0])
    same(mixed[1], m.run("step", [Unit("step", [5], row=other[0].row)])[0])


def _drive(m, work, kinds=None):
    """Run a job's generator of units alone (each unit a batch of one) to its end; its result."""
    try:
        unit = next(work)
        while True:
            if kinds is not None:
                kinds.append(unit.kind)
            unit = work.send(m.run(unit.kind, [unit])[0])
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("with_memory", [True, False])
@pytest.mark.parametrize("new_tokens", [1, 4, 30])
def test_generated_tokens_join_the_session_as_if_read(model_dir, tmp_path, new_tokens, with_memory, same_length):
    """A session that generated tokens ends as one that read them: same log-probs summed, same memory. Without
    same_length, the tokens inside the unfinished segment are not read again, the memory at the segment's end
    comes from the generation's rows, and only tokens past it are read (the session holds 5 tokens of its
    segment of 8: 1 new token stays in it, 4 complete it, 30 cross four boundaries)."""
    from serve_util import loader

    from txl.serve.engine import Engine, Model
    from txl.serve.session import SessionState, SessionStore

    model, tokenizer, _ = loader(model_dir)()
    m = Model(model, segment_len=8, mem_len=8, same_length=same_length, clamp_len=0)
    engine = Engine(m, tokenizer, SessionStore(tmp_path, max_in_memory=4, ttl=60), max_queue=4, max_batch=4,
                    durable=False)
    text = [int(i) for i in tokenizer.encode_prompt(TEXT[:12])]  # after the context token (a line break): 13
    state = SessionState(id="", tokens=list(engine.context_ids), with_memory=with_memory)
    _drive(m, engine.read_ids(state, text))
    assert len(state.tokens) == 5
    kinds = []
    job = type("Job", (), {"cancelled": False})()
    out = _drive(m, engine.generate(state, max_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                                     stop=[], job=job), kinds)
    assert len(out["ids"]) == new_tokens
    read = SessionState(id="", tokens=list(engine.context_ids), with_memory=with_memory)
    _drive(m, engine.read_ids(read, text + out["ids"]))
    assert state.tokens == read.tokens and state.n_tokens == read.n_tokens and state.n_scored == read.n_scored
    assert state.nll == pytest.approx(read.nll, rel=1e-6)
    if with_memory:
        torch.testing.assert_close(state.memory, read.memory, atol=1e-5, rtol=1e-5)
    else:
        assert state.memory is None and read.memory is None
    if not same_length:  # read again: nothing; nothing (the segment ends with them); 3 segments and 3 tokens
        assert kinds.count("score") == {1: 0, 4: 0, 30: 4}[new_tokens]


@pytest.mark.parametrize("first", [2, 8])
def test_a_generation_steps_on_from_the_last_ones_rows(model_dir, tmp_path, first):
    """A generation right after another on the same session starts with one step from the rows the first one
    kept (no prefill) and samples what a generation reading the session afresh samples, with the same log-probs;
    after a segment ended (8 new tokens past the 5 the session holds) the rows are stale and it reads afresh."""
    from serve_util import loader

    from txl.serve.engine import Engine, Model
    from txl.serve.session import SessionState, SessionStore

    model, tokenizer, _ = loader(model_dir)()
    m = Model(model, segment_len=8, mem_len=8, same_length=False, clamp_len=0)
    engine = Engine(m, tokenizer, SessionStore(tmp_path, max_in_memory=4, ttl=60), max_queue=4, max_batch=4,
                    durable=False)
    job = type("Job", (), {"cancelled": False})()
    outs, kinds = [], []
    for reuse in (True, False):
        state = SessionState(id="", tokens=list(engine.context_ids))
        _drive(m, engine.read_ids(state, [int(i) for i in tokenizer.encode_prompt(TEXT[:13])]))
        for n in (first, 5):
            if not reuse:
                state.generation = None
            kinds.append([])
            outs.append(_drive(m, engine.generate(state, max_tokens=n, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                                                  stop=[], job=job), kinds[-1]))
    assert outs[1]["ids"] == outs[3]["ids"]
    np.testing.assert_allclose(outs[1]["logprobs"], outs[3]["logprobs"], atol=1e-5)
    assert kinds[1][0] == ("step" if first == 2 else "prefill") and kinds[3][0] == "prefill"


def test_one_sessions_requests_never_interleave(server):
    """Concurrent requests on one session (text and generation) and on others: each is applied whole, in the
    order the server reports, and a serial replay in that order gives the same totals."""
    sid, other = new_session(server), new_session(server)
    pieces = cut(TEXT[:120], 10)
    # The first piece is read before the others are sent: a generation may come first among them, and it needs
    # text to continue (an empty session's generation is refused with 400, rightly).
    assert server.post(f"/v1/sessions/{sid}/text", json={"text": pieces[0]}).status_code == 200

    def send(i):
        if i % 4 == 3:
            r = server.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 6, "seed": i, "temperature": 0})
        else:
            r = server.post(f"/v1/sessions/{sid}/text", json={"text": pieces[i]})
        server.post(f"/v1/sessions/{other}/text", json={"text": pieces[i]})
        assert r.status_code == 200, r.text
        return i, r.json()["session"]["requests"]

    with futures.ThreadPoolExecutor(6) as pool:
        order = sorted(pool.map(send, range(1, len(pieces))), key=lambda x: x[1])
    # The creation is request 1, the first piece 2: each concurrent one counted once, after them.
    assert [n for _, n in order] == list(range(3, len(pieces) + 2))
    final = server.get(f"/v1/sessions/{sid}").json()
    replay = new_session(server)
    server.post(f"/v1/sessions/{replay}/text", json={"text": pieces[0]})
    for i, _ in order:
        if i % 4 == 3:
            server.post(f"/v1/sessions/{replay}/generate", json={"max_tokens": 6, "seed": i, "temperature": 0})
        else:
            server.post(f"/v1/sessions/{replay}/text", json={"text": pieces[i]})
    again = server.get(f"/v1/sessions/{replay}").json()
    assert again["tokens_read"] == final["tokens_read"] and again["tokens_generated"] == final["tokens_generated"]
    assert again["nll"] == pytest.approx(final["nll"], rel=1e-6)


def test_spilled_sessions_come_back(server, expected):
    """Five sessions read the document in turns with two in RAM: each is spilled to disk and read back, and
    its scores equal the whole document's."""
    before = _metric(server, "txl_evictions_total")
    ids = [new_session(server) for _ in range(5)]
    got = {sid: [] for sid in ids}
    for piece in cut(TEXT, 40):
        for sid in ids:
            r = server.post(f"/v1/sessions/{sid}/text", json={"text": piece, "logprobs": True})
            got[sid] += [t["logprob"] for t in r.json()["logprobs"] if t["logprob"] is not None]
    assert _metric(server, "txl_evictions_total") - before >= 5 * 5
    assert all((server.state_dir / f"{sid}.safetensors").is_file() for sid in ids)
    for sid in ids:
        np.testing.assert_allclose(got[sid], expected, atol=1e-5, rtol=0)
    r = server.delete(f"/v1/sessions/{ids[0]}")
    assert r.status_code == 200 and not (server.state_dir / f"{ids[0]}.safetensors").exists()
    assert server.get(f"/v1/sessions/{ids[0]}").status_code == 404


def _metric(client, name):
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_health_and_generation_joins_the_session(server):
    sid = new_session(server)
    server.post(f"/v1/sessions/{sid}/text", json={"text": "The cat sat on the mat."})
    r = server.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, "seed": 3})
    info = r.json()["session"]
    assert info["tokens_read"] == 23 + 5 and info["tokens_generated"] == 5 and info["tokens_scored"] == 23 + 5
    assert info["memory"]["shape"] == [2, 8, 32] and info["memory"]["bytes"] == 2 * 8 * 32 * 4
    assert server.get("/health").json()["status"] == "ok"
    text = server.get("/metrics").text
    for name in ("txl_requests_total", "txl_tokens_read_total", "txl_tokens_generated_total", "txl_sessions_in_memory",
                 "txl_sessions_on_disk", "txl_evictions_total", "txl_queue_depth", "txl_request_seconds_bucket"):
        assert name in text


def test_dropped_stream_leaves_the_session_consistent(server):
    sid = new_session(server)
    server.post(f"/v1/sessions/{sid}/text", json={"text": TEXT[:50]})
    with server.stream("POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 64, "stream": True}) as s:
        assert s.status_code == 200
        next(s.iter_lines())  # one event, then the client goes away
    time.sleep(0.2)
    info = server.get(f"/v1/sessions/{sid}").json()
    assert info["tokens_read"] == 50 + info["tokens_generated"] and info["tokens_generated"] <= 64
    r = server.post(f"/v1/sessions/{sid}/text", json={"text": "more text"})
    assert r.status_code == 200 and r.json()["session"]["tokens_read"] == info["tokens_read"] + 9


def test_openai_client_streaming_and_not(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(server.base_url) + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="The cat", max_tokens=12, seed=7, temperature=0.8,
                                     logprobs=2)
    choice = done.choices[0]
    assert done.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 12 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    streamed = client.completions.create(model="tiny", prompt="The cat", max_tokens=12, seed=7, temperature=0.8,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    echo = client.completions.create(model="tiny", prompt="The cat", max_tokens=3, seed=7, temperature=0.8, echo=True)
    assert echo.choices[0].text.startswith("The cat")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert "max_tokens" in str(err.value)


def test_idle_sessions_expire(model_dir, tmp_path):
    app = create_app(ServeConfig(state_dir=str(tmp_path), session_ttl=0.5), loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url) as client:
        sid = new_session(client)
        assert (tmp_path / f"{sid}.safetensors").is_file()
        for _ in range(100):  # bounded: the sweep runs every ttl/4
            time.sleep(0.1)
            if not (tmp_path / f"{sid}.safetensors").exists():
                break
        assert client.get(f"/v1/sessions/{sid}").status_code == 404
        assert not (tmp_path / f"{sid}.safetensors").exists()


def test_keys_own_their_sessions(model_dir, tmp_path):
    app = create_app(ServeConfig(state_dir=str(tmp_path), api_key="k-one,k-two"), loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url) as client:
        one, two = ({"Authorization": f"Bearer {k}"} for k in ("k-one", "k-two"))
        assert client.get("/health").status_code == 200  # open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k-one"}):
            r = client.post("/v1/sessions", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["field"] == "Authorization"
        assert client.get("/metrics").status_code == 401
        sid = client.post("/v1/sessions", headers=one).json()["id"]
        assert client.get(f"/v1/sessions/{sid}", headers=one).status_code == 200
        for method in ("get", "delete"):
            r = getattr(client, method)(f"/v1/sessions/{sid}", headers=two)
            assert r.status_code == 404 and r.json()["error"]["field"] == "session"
        r = client.post("/v1/completions", headers=two, json={"prompt": "a", "session": sid, "max_tokens": 1})
        assert r.status_code == 404
        assert client.get(f"/v1/sessions/{sid}", headers=one).status_code == 200  # still there
        assert "k-one" not in (tmp_path / f"{sid}.safetensors").read_bytes().decode("latin1")
