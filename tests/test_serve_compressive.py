"""`txl serve` with a compressive model (Rae et al. 2020, txl.model.compressive): a session carries both memories
at a fixed size, reads as `txl score` reads, generates as the library generates from the same state, survives a
spill and a restart, and GET /v1/sessions/{id} reports both shapes."""


import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
from txl.model import TransformerXL

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import TEXT, loader, make_model_dir, running, txl_score_logprobs  # noqa: E402

from txl.serve import ServeConfig, create_app  # noqa: E402
from txl.serve.engine import Model, Unit  # noqa: E402
from txl.serve.session import SessionState  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
SEGMENT, MEM, CMEM, RATE = 8, 8, 4, 3
"""Segments of 8, memory 8, 4 compressed slots at rate 3: rows leave in groups of 3, so the memory keeps 8 to 10
rows and the compressed memory fills after two segments."""
PROMPT = "The cat sat"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("cserve") / "char", cmem_len=CMEM, cmem_rate=RATE)


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory):
    """`txl score`'s per-token log-probs of TEXT (the command's JSONL)."""
    return txl_score_logprobs(model_dir, tmp_path_factory.mktemp("score"), SEGMENT)


def app(state_dir, model_dir, **overrides):
    return create_app(ServeConfig(state_dir=str(state_dir), segment_len=SEGMENT, durability="shutdown",
                                  **overrides), loader(model_dir))


def send(client, sid, text, *, final=False):
    r = client.post(f"/v1/sessions/{sid}/text", json={"text": text, "final": final, "logprobs": True})
    assert r.status_code == 200, r.text
    return [t["logprob"] for t in r.json()["logprobs"] if t["logprob"] is not None]


def check_fixed_size(info, *, full: bool):
    """The state stays a fixed size: memory mem_len .. mem_len + c - 1 rows, compressed at most cmem_len slots."""
    L, d = 2, 32
    assert info["memory"]["max_shape"] == [L, MEM + RATE - 1, d]
    assert info["compressed_memory"]["max_shape"] == [L, CMEM, d] and info["compressed_memory"]["rate"] == RATE
    mem, cmem = info["memory"]["shape"], info["compressed_memory"]["shape"]
    assert mem[0] == L and mem[2] == d and MEM <= mem[1] <= MEM + RATE - 1
    assert cmem == [L, CMEM, d] if full else (cmem[0] == L and 0 <= cmem[1] <= CMEM)
    assert info["compressed_memory"]["bytes"] == cmem[1] * L * d * 4


def test_a_session_reads_as_txl_score_at_a_fixed_size_across_spills_and_a_restart(model_dir, expected, tmp_path):
    """Text read in pieces by two sessions that spill each other to disk (one in RAM), then by a server restarted on
    the same state: the log-probs are `txl score`'s, and both memories stay within their sizes."""
    from safetensors import safe_open

    half = len(TEXT) // 2
    with running(app(tmp_path, model_dir, max_sessions_in_memory=1)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        a, b = (client.post("/v1/sessions").json()["id"] for _ in range(2))
        got_a, got_b = [], []
        for i in range(0, half, 23):
            got_a += send(client, a, TEXT[i:min(i + 23, half)])
            got_b += send(client, b, TEXT[i:min(i + 23, half)])  # evicts a: a is read back from its file next
            check_fixed_size(client.get(f"/v1/sessions/{a}").json(), full=i > 3 * SEGMENT)
        with safe_open(str(tmp_path / f"{a}.safetensors"), framework="pt") as f:
            assert f.get_tensor("compressed").shape == (2, CMEM, 32) and f.get_tensor("memory").shape[1] >= MEM
    with running(app(tmp_path, model_dir)) as url, httpx.Client(base_url=url, timeout=60) as client:
        got_a += send(client, a, TEXT[half:], final=True)
        got_b += send(client, b, TEXT[half:], final=True)
        check_fixed_size(client.get(f"/v1/sessions/{b}").json(), full=True)
    np.testing.assert_allclose(got_a, expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_b, expected, atol=1e-5, rtol=0)


def library_state(model, ids, ctx):
    """Read ``ids`` as `txl score` reads them (segments of SEGMENT labels, both memories carried): the state at the
    last boundary, the tokens since, and every token's log-prob (label j = ids[j + 1])."""
    state, lps = None, []
    with torch.no_grad():
        while len(ids) - 1 >= SEGMENT:
            x, y = torch.tensor([ids[:SEGMENT]]), torch.tensor([ids[1:SEGMENT + 1]])
            lp, out = txl.decoding.read(model, x, y, state, context=ctx)
            lps += lp[0].tolist()
            state, ids = out.memory, ids[SEGMENT:]
        if len(ids) >= 2:
            lp, _ = txl.decoding.read(model, torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]), state, context=ctx)
            lps += lp[0].tolist()
    return state, ids, lps


def greedy(model, ids, n, ctx):
    """n greedy tokens after ``ids`` read as a session reads them, each by a whole uncached forward of the tokens
    since the boundary after that state (nothing compressed while generating, as txl.generate): tokens, log-probs."""
    state, since, _ = library_state(model, ids, ctx)
    whole = model.config.context(mem_len=1 << 30, same_length=False, clamp_len=ctx.clamp_len, ext_len=0)
    tokens, lps = [], []
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([since + tokens]), memory=state, context=whole, return_log_probs=True)
            lp = out.log_probs[0, -1].float()  # (V,)
            tokens.append(int(lp.argmax()))
            lps.append(float(lp.max()))
    return tokens, lps


def test_generation_after_compressed_text_is_the_librarys_from_the_same_state(model_dir, tmp_path):
    """A session that has read enough text to fill its compressed memory generates (twice in a row: the second
    steps on from the first's rows) what whole forwards of the model give from the state `txl score` reads; the
    session then holds the score `txl score` gives the whole (text, generated tokens, more text)."""
    with running(app(tmp_path, model_dir)) as url, httpx.Client(base_url=url, timeout=60) as client:
        model, tok, _ = loader(model_dir)()
        ctx = Model(model, segment_len=SEGMENT).read_ctx
        ids = ([] if tok.context_id is None else [int(tok.context_id)]) + [int(i) for i in tok.encode_prompt(TEXT[:61])]
        sid = client.post("/v1/sessions").json()["id"]
        got = send(client, sid, TEXT[:61], final=True)
        check_fixed_size(client.get(f"/v1/sessions/{sid}").json(), full=True)
        produced = []
        for n in (2, 4, 3):  # 2 leave the segment unfinished: the next steps on from their rows; 4 complete it
            want, want_lps = greedy(model, ids + produced, n, ctx)
            r = client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": n, "temperature": 0, "logprobs": True})
            assert r.status_code == 200, r.text
            out = r.json()
            assert [g["token"] for g in out["logprobs"]] == [tok.token_text(t) for t in want]
            np.testing.assert_allclose([g["logprob"] for g in out["logprobs"]], want_lps, atol=1e-4)
            produced += want
            check_fixed_size(out["session"], full=True)
        more = TEXT[61:90]
        send(client, sid, more, final=True)
        info = client.get(f"/v1/sessions/{sid}").json()
    # The session's score of everything it holds is the reading's (a generated token past a segment boundary was
    # drawn seeing its rows uncompressed; the session scores it as reading it sees it: after the compression).
    whole = ids + produced + [int(i) for i in tok.encode_prompt(more)]
    _, _, want_all = library_state(model, whole, ctx)
    np.testing.assert_allclose(got, want_all[:len(got)], atol=1e-5)
    assert info["tokens_scored"] == len(want_all) and len(produced) == 9
    assert info["nll"] == pytest.approx(-sum(want_all), abs=1e-3)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_k=5, seed=3)])
def test_served_generation_equals_txl_generate(model_dir, tmp_path, sampling):
    """A prompt shorter than a segment: /v1/sessions/{id}/generate and /v1/completions sample what txl.generate
    samples from it, token for token, with the same log-probabilities."""
    from txl.generation import generate_steps

    model, tok, _ = loader(model_dir)()
    ids = ([] if tok.context_id is None else [int(tok.context_id)]) + [int(i) for i in tok.encode_prompt(PROMPT)]
    steps = list(generate_steps(model, ids, max_new_tokens=12, **sampling))
    want, want_lps = [int(s.tokens[0]) for s in steps], [float(s.logprobs[0]) for s in steps]
    with running(app(tmp_path, model_dir, max_tokens=64)) as url, httpx.Client(base_url=url, timeout=60) as client:
        sid = client.post("/v1/sessions").json()["id"]
        send(client, sid, PROMPT)
        r = client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 12, "logprobs": True, **sampling})
        assert r.status_code == 200, r.text
        assert [g["token"] for g in r.json()["logprobs"]] == [tok.token_text(t) for t in want]
        np.testing.assert_allclose([g["logprob"] for g in r.json()["logprobs"]], want_lps, atol=1e-4)
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "logprobs": 1, **sampling})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [tok.token_text(t) for t in want]
        assert r.json()["choices"][0]["text"] == tok.decode(want)


def test_batched_rows_of_different_lengths_equal_rows_alone(model_dir):
    """Units whose memories (or compressed memories) differ in length run in groups of equal lengths, no pads:
    each computes what it computes alone, for reading, prefill, steps of a kept batch, a subset and a mix."""
    m = Model(txl.from_pretrained(model_dir), segment_len=5)
    g = torch.Generator().manual_seed(0)
    V = m.model.config.vocab_size
    ids = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(4)]
    memories = [None, torch.randn(2, 8, 32, generator=g), torch.randn(2, 9, 32, generator=g),
                torch.randn(2, 8, 32, generator=g)]
    compressed = [None, torch.randn(2, 2, 32, generator=g), torch.randn(2, 4, 32, generator=g),
                  torch.randn(2, 2, 32, generator=g)]
    score = [Unit("score", x[:5], mem, x[1:], compressed=c) for x, mem, c in zip(ids, memories, compressed)]
    for u, t in zip(score, m.run("score", score)):
        [alone] = m.run("score", [u])
        np.testing.assert_allclose(t.logprobs, alone.logprobs, atol=1e-5)
        torch.testing.assert_close(t.memory, alone.memory)
        torch.testing.assert_close(t.compressed, alone.compressed)
        if u.memory is None:  # 5 rows read: nothing left the memory yet
            assert t.memory.size(1) == 5 and t.compressed is None
        else:
            assert MEM <= t.memory.size(1) <= MEM + RATE - 1 and 0 < t.compressed.size(1) <= CMEM

    def same(batched, alone):
        torch.testing.assert_close(batched.next_log_probs, alone.next_log_probs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m.take(batched.row)[0], m.take(alone.row)[0], atol=1e-5, rtol=1e-5)

    prefill = [Unit("prefill", x[:5], mem, compressed=c) for x, mem, c in zip(ids, memories, compressed)]
    together = m.run("prefill", prefill)
    alone = [m.run("prefill", [u])[0] for u in prefill]
    for t, a in zip(together, alone):
        same(t, a)
    rows = [together[1], together[3]]  # equal lengths: one forward, one batch
    assert rows[0].row[0] is rows[1].row[0] and together[2].row[0] is not rows[0].row[0]
    mix = [Unit("step", [1], row=alone[1].row), Unit("step", [1], row=alone[3].row)]  # rows of two batches
    for step in range(2):  # the batch's tensors as they are
        units = [Unit("step", [step + 1], row=r.row) for r in rows]
        each = [m.run("step", [u])[0] for u in units]
        rows = m.run("step", units)
        for t, a in zip(rows, each):
            same(t, a)
        if step == 0:
            for t, a in zip(m.run("step", mix), rows):  # gathered into one batch: the same as the batch's rows
                same(t, a)
    sub = m.run("step", [Unit("step", [3], row=rows[1].row)])[0]  # a subset of the batch
    memory, kv = m.take(rows[1].row)  # a row kept for the session's next generation: its window's keys too
    assert memory.size(1) == 8 + 5 + 2  # generation keeps every row it read, uncompressed
    assert kv[0].shape == kv[1].shape == (2, 2 + 8 + 5 + 2, 4, 8)  # (L, C + m, H, D): the window [compressed; memory]
    same(sub, m.run("step", [Unit("step", [3], memory, compressed=compressed[3])])[0])  # keys projected again
    same(sub, m.run("step", [Unit("step", [3], memory, compressed=compressed[3], kv=kv)])[0])  # keys as kept


def test_session_files_hold_both_memories_and_older_files_still_read(tmp_path):
    L, d = 2, 32
    state = SessionState(id="x" * 32, memory=torch.randn(L, 9, d), compressed=torch.randn(L, 3, d), tokens=[1, 2])
    state.to_file(tmp_path / "new.safetensors")
    back = SessionState.from_file(tmp_path / "new.safetensors")
    torch.testing.assert_close(back.memory, state.memory)
    torch.testing.assert_close(back.compressed, state.compressed)
    older = SessionState(id="y" * 32, memory=torch.randn(L, 8, d), tokens=[3])  # as files were written before
    older.to_file(tmp_path / "old.safetensors")
    back = SessionState.from_file(tmp_path / "old.safetensors")
    assert back.compressed is None and back.tokens == [3]
    info = back.info(n_layer=L, mem_len=8, d_model=d, cmem_len=4, cmem_rate=3)
    assert info["compressed_memory"] == {"shape": [L, 0, d], "max_shape": [L, 4, d], "rate": 3, "bytes": 0}
    assert "compressed_memory" not in back.info(n_layer=L, mem_len=8, d_model=d)  # a plain model's report


def test_a_compressive_model_is_refused_at_load_where_it_cannot_read():
    torch.manual_seed(0)
    model = TransformerXL(tiny_config(mem_len=MEM, cmem_len=CMEM, cmem_rate=RATE))
    with pytest.raises(ValueError, match=r"serve it with mem_len > 0 \(got 0\) and same_length false"):
        Model(model, segment_len=4, mem_len=0)
    with pytest.raises(ValueError, match=r"same_length false \(got True\)"):
        Model(model, segment_len=4, same_length=True)
