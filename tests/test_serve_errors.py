"""`txl serve`'s bad requests: each gets a JSON error naming the field and the reason, with the right status
(400/422/404/405/413/429/503), never a 500, a traceback or a server path."""

import concurrent.futures as futures
import logging
import socket
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import loader, make_model_dir, running  # noqa: E402

from txl.serve import ServeConfig, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
UNKNOWN = "A" * 32  # the shape of a session id, but no session


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("serve-errors") / "char")


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    app = create_app(ServeConfig(state_dir=str(state), segment_len=16, max_text_chars=100, max_tokens=50,
                                 max_body_bytes=2000, durability="shutdown"), loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        c.state_dir = str(state)
        c.sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{c.sid}/text", json={"text": "The cat sat."})
        yield c


C, T, G = "/v1/completions", "/v1/sessions/{sid}/text", "/v1/sessions/{sid}/generate"
OCTET = {"content-type": "application/octet-stream"}
JSON = {"content-type": "application/json"}
CASES = [  # (what, method, path, request arguments, status, field)
    ("malformed JSON", "post", C, dict(content=b'{"prompt": "a",', headers={"content-type": "application/json"}),
     400, "body"),
    ("JSON that is not an object", "post", C, dict(json=[1, 2]), 422, "body"),
    ("non-UTF-8 JSON body", "post", C, dict(content=b'{"prompt": "\xff\xfe"}',
                                            headers={"content-type": "application/json"}), 400, "body"),
    ("empty body", "post", C, dict(content=b"", headers={"content-type": "application/json"}), 400, "body"),
    ("prompt is a number", "post", C, dict(json={"prompt": 5}), 422, "prompt"),
    ("max_tokens is a string", "post", C, dict(json={"prompt": "a", "max_tokens": "5"}), 422, "max_tokens"),
    ("max_tokens is a fraction", "post", C, dict(json={"prompt": "a", "max_tokens": 1.5}), 422, "max_tokens"),
    ("negative max_tokens", "post", C, dict(json={"prompt": "a", "max_tokens": -1}), 400, "max_tokens"),
    ("huge max_tokens", "post", C, dict(json={"prompt": "a", "max_tokens": 10**9}), 400, "max_tokens"),
    ("temperature < 0", "post", C, dict(json={"prompt": "a", "temperature": -0.5}), 400, "temperature"),
    ("temperature NaN", "post", C, dict(content=b'{"prompt": "a", "temperature": NaN}',
                                        headers={"content-type": "application/json"}), 400, "temperature"),
    ("temperature is text", "post", C, dict(json={"prompt": "a", "temperature": "hot"}), 422, "temperature"),
    ("top_p > 1", "post", C, dict(json={"prompt": "a", "top_p": 1.5}), 400, "top_p"),
    ("top_p 0", "post", C, dict(json={"prompt": "a", "top_p": 0}), 400, "top_p"),
    ("negative top_k", "post", C, dict(json={"prompt": "a", "top_k": -3}), 400, "top_k"),
    ("negative seed", "post", C, dict(json={"prompt": "a", "seed": -1}), 400, "seed"),
    ("five stop texts", "post", C, dict(json={"prompt": "a", "stop": list("abcde")}), 400, "stop"),
    ("an empty stop text", "post", C, dict(json={"prompt": "a", "stop": [""]}), 400, "stop"),
    ("stream is a string", "post", C, dict(json={"prompt": "a", "stream": "yes"}), 422, "stream"),
    ("logprobs 6", "post", C, dict(json={"prompt": "a", "logprobs": 6}), 400, "logprobs"),
    ("n 2", "post", C, dict(json={"prompt": "a", "n": 2}), 400, "n"),
    ("presence_penalty", "post", C, dict(json={"prompt": "a", "presence_penalty": 1.0}), 400, "presence_penalty"),
    ("an unknown field", "post", C, dict(json={"prompt": "a", "temprature": 1}), 422, "temprature"),
    ("two prompts on one session", "post", C, dict(json={"prompt": ["a", "b"], "session": "{sid}"}), 400, "session"),
    ("two prompts streamed", "post", C, dict(json={"prompt": ["a", "b"], "stream": True}), 400, "stream"),
    ("a token id out of range", "post", C, dict(json={"prompt": [1, 10**6]}), 400, "prompt"),
    ("another model", "post", C, dict(json={"prompt": "a", "model": "gpt-4"}), 404, "model"),
    ("empty prompt, no session", "post", C, dict(json={"prompt": ""}), 400, "prompt"),
    ("unknown session", "post", C, dict(json={"prompt": "a", "session": UNKNOWN}), 404, "session"),
    ("a session id of the wrong shape", "post", C, dict(json={"prompt": "a", "session": "../x"}), 404, "session"),
    ("prompt too long", "post", C, dict(json={"prompt": "a" * 101}), 413, "prompt"),
    ("body too large", "post", C, dict(json={"prompt": "a" * 3000}), 413, "body"),
    ("body too large, chunked", "post", C, dict(content=iter([b'{"prompt": "', b"a" * 3000, b'"}']),
                                                headers={"content-type": "application/json"}), 413, "body"),
    ("empty text", "post", T, dict(json={"text": ""}), 400, "text"),
    ("text is a number", "post", T, dict(json={"text": 3}), 422, "text"),
    ("no text", "post", T, dict(json={"logprobs": True}), 400, "text"),
    ("text field misspelt", "post", T, dict(json={"txt": "a"}), 422, "txt"),
    ("final is a string", "post", T, dict(json={"text": "a", "final": "yes"}), 422, "final"),
    ("raw text not UTF-8", "post", T, dict(content=b"ab\xff\xfecd", headers=OCTET), 400, "text"),
    ("raw text, logprobs=maybe", "post", T + "?logprobs=maybe", dict(content=b"ab", headers=OCTET), 422, "logprobs"),
    ("text too long", "post", T, dict(json={"text": "a" * 101}), 413, "text"),
    ("text as curl's default form type", "post", T, dict(
        content=b'{"text": "hello", "final": true}', headers={"content-type": "application/x-www-form-urlencoded"}),
     415, "Content-Type"),
    ("text as XML", "post", T, dict(content=b"<text>hello</text>", headers={"content-type": "application/xml"}),
     415, "Content-Type"),
    # One rule for every endpoint that reads JSON: application/json (UTF-8), else 415 naming the type expected.
    ("a completion sent as text/plain", "post", C, dict(content=b'{"prompt": "a"}', headers={
        "content-type": "text/plain"}), 415, "Content-Type"),
    ("a completion sent as curl's default form type", "post", C, dict(content=b'{"prompt": "a"}', headers={
        "content-type": "application/x-www-form-urlencoded"}), 415, "Content-Type"),
    ("a completion without a Content-Type", "post", C, dict(content=b'{"prompt": "a"}'), 415, "Content-Type"),
    ("a completion as JSON in latin-1", "post", C, dict(content=b'{"prompt": "a"}', headers={
        "content-type": "application/json; charset=latin-1"}), 415, "Content-Type"),
    ("generate sent as XML", "post", G, dict(content=b"<max_tokens>2</max_tokens>", headers={
        "content-type": "application/xml"}), 415, "Content-Type"),
    ("tokenize sent as text/plain", "post", "/tokenize", dict(content=b'{"prompt": "a"}', headers={
        "content-type": "text/plain"}), 415, "Content-Type"),
    ("detokenize sent as a form", "post", "/detokenize", dict(content=b"tokens=1", headers={
        "content-type": "application/x-www-form-urlencoded"}), 415, "Content-Type"),
    ("create a session with a body sent as text/plain", "post", "/v1/sessions", dict(
        content=b'{"memory": false}', headers={"content-type": "text/plain"}), 415, "Content-Type"),
    ("text in a charset nobody knows", "post", T, dict(content=b"abc", headers={
        "content-type": "text/plain; charset=klingon"}), 415, "Content-Type"),
    ("text that is not the UTF-16 it declares", "post", T, dict(content=b"abc", headers={
        "content-type": "text/plain; charset=utf-16-le"}), 400, "text"),
    ("JSON nested deeper than the decoder goes", "post", C, dict(
        content=b'{"prompt": "a", "stream_options": {"x": ' + b"[" * 1900,
        headers={"content-type": "application/json"}), 400, "body"),
    ("an unclosed nest of 1,900 lists", "post", T, dict(content=b"[" * 1900, headers=JSON), 400, "body"),
    ("text to an unknown session", "post", T.format(sid=UNKNOWN), dict(json={"text": "a"}), 404, "session"),
    ("generate on an unknown session", "post", G.format(sid=UNKNOWN), dict(json={}), 404, "session"),
    ("generate with top_p 2", "post", G, dict(json={"top_p": 2}), 400, "top_p"),
    ("create with memory 'no'", "post", "/v1/sessions", dict(json={"memory": "no"}), 422, "memory"),
    ("get an unknown session", "get", f"/v1/sessions/{UNKNOWN}", {}, 404, "session"),
    ("delete an unknown session", "delete", f"/v1/sessions/{UNKNOWN}", {}, 404, "session"),
    ("an unknown endpoint", "get", "/v1/nothing", {}, 404, None),
    ("a wrong method", "get", C, {}, 405, None),
]


@pytest.mark.parametrize("what,method,path,kwargs,status,field", CASES, ids=[c[0] for c in CASES])
def test_bad_request(client, what, method, path, kwargs, status, field):
    url = path.format(sid=client.sid)
    if kwargs.get("json", {}).get("session") == "{sid}" if isinstance(kwargs.get("json"), dict) else False:
        kwargs = {**kwargs, "json": {**kwargs["json"], "session": client.sid}}  # the client's own session
    r = client.request(method.upper(), url, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["field"] == field and error["reason"] and error["code"] == status
    for leak in ("Traceback", client.state_dir, "/site-packages/", ".py"):
        assert leak not in r.text
    # The session the bad requests were aimed at is untouched and usable.
    assert client.get(f"/v1/sessions/{client.sid}").json()["tokens_read"] == 12


def test_the_table_is_large_enough():
    assert len(CASES) >= 30


def test_full_queue_gets_429(model_dir, tmp_path):
    """Twelve generations queued on one session with max_queue=1: some are refused with 429, the rest run."""
    app = create_app(ServeConfig(state_dir=str(tmp_path), max_queue=1, durability="shutdown"), loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{sid}/text", json={"text": "The cat sat."})
        barrier = threading.Barrier(12)

        def go(_):
            barrier.wait()
            return c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 200})

        with futures.ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(go, range(12)))
        codes = sorted(r.status_code for r in replies)
        assert set(codes) == {200, 429}, codes
        full = next(r for r in replies if r.status_code == 429)
        assert full.headers["retry-after"] == "1" and "max_queue" in full.json()["error"]["reason"]
        ok = sum(r.json()["tokens"] for r in replies if r.status_code == 200)
        assert c.get(f"/v1/sessions/{sid}").json()["tokens_generated"] == ok


def test_503_while_the_model_loads(model_dir, tmp_path):
    gate = threading.Event()
    load = loader(model_dir)

    def slow():
        gate.wait(30)
        return load()

    app = create_app(ServeConfig(state_dir=str(tmp_path)), slow)
    try:
        with running(app, ready=False) as url, httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "a"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["reason"] == "the model is loading"
            assert c.get("/health").status_code == 503
            gate.set()
            for _ in range(600):  # bounded
                if c.get("/health").status_code == 200:
                    break
                time.sleep(0.05)
            assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
    finally:
        gate.set()


def test_a_state_that_cannot_be_written_gets_507(model_dir, tmp_path, monkeypatch):
    """Durable writes run on writer threads: a failed one answers 507 (not 500, no path), the others of the batch
    are written, and once the disk works again the session reads on and is written."""
    from txl.serve.session import SessionStore

    app = create_app(ServeConfig(state_dir=str(tmp_path)), loader(model_dir))  # durability 'request'
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        sids = [c.post("/v1/sessions").json()["id"] for _ in range(4)]
        write = SessionStore.write

        def full(self, state):
            if state.id == sids[0]:
                raise OSError(28, "No space left on device", str(tmp_path))
            write(self, state)

        monkeypatch.setattr(SessionStore, "write", full)
        with futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda sid: c.post(f"/v1/sessions/{sid}/text", json={"text": "The cat sat."}),
                                    sids))
        assert [r.status_code for r in replies] == [507, 200, 200, 200]
        error = replies[0].json()["error"]
        assert "could not be written" in error["reason"] and str(tmp_path) not in replies[0].text
        monkeypatch.setattr(SessionStore, "write", write)
        r = c.post(f"/v1/sessions/{sids[0]}/text", json={"text": " More."})
        assert r.status_code == 200 and r.json()["session"]["tokens_read"] == len("The cat sat. More.")
        assert all((tmp_path / f"{sid}.safetensors").is_file() for sid in sids)


def test_a_bad_request_logs_one_access_line(client, caplog):
    """A body nested too deeply for the JSON decoder is a 400 with one access line, no traceback (issue 36:
    it was a 500 with ~120 log lines)."""
    caplog.set_level(logging.INFO)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's own: an earlier torch.compile in this process may have raised it
    try:
        r = client.post(C, content=b"[" * 1900, headers={"content-type": "application/json"})
    finally:
        sys.setrecursionlimit(limit)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["reason"]
    assert _access_lines(caplog, 400, timeout=10) == 1  # logged just after the answer is sent
    assert [rec for rec in caplog.records if rec.levelno >= logging.WARNING] == []


def _access_lines(caplog, status: int, timeout: float = 0.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = sum(1 for rec in caplog.records if rec.name == "txl.serve.access" and f'" {status} ' in rec.getMessage())
        if n or time.monotonic() >= deadline:
            return n
        time.sleep(0.02)


def test_a_client_that_leaves_mid_body_is_one_quiet_499(client, caplog):
    """A client that disconnects before its body is complete gets one access line with 499 (nothing can be
    answered), no error logged and no 500 counted; the server serves on."""
    caplog.set_level(logging.INFO)
    host, port = str(client.base_url.host), client.base_url.port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)  # the request is being read
    assert _access_lines(caplog, 499, timeout=10) == 1
    assert [rec for rec in caplog.records if rec.levelno >= logging.WARNING] == []
    assert 'status="500"' not in client.get("/metrics").text
    assert client.get(f"/v1/sessions/{client.sid}").status_code == 200


def test_text_of_another_content_type_reads_nothing(client):
    """415 for a body that is neither JSON nor raw text; the session has read nothing of it."""
    sid = client.post("/v1/sessions").json()["id"]
    r = client.post(f"/v1/sessions/{sid}/text", content=b'{"text": "hello", "final": true}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/x-www-form-urlencoded" in r.json()["error"]["reason"]
    assert client.get(f"/v1/sessions/{sid}").json()["tokens_read"] == 0
    r = client.post(f"/v1/sessions/{sid}/text", content=b"hello", headers={"content-type": "text/plain; charset=utf-8"})
    assert r.status_code == 200 and r.json()["tokens"] == 5


def test_json_refused_as_another_type_names_the_type_expected(client):
    r = client.post("/v1/completions", content=b'{"prompt": "a"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["reason"]
    assert "text/plain" in r.json()["error"]["reason"]


def test_text_is_read_in_the_charset_it_declares(client):
    """text/plain; charset=latin-1: the byte 0xe9 is 'é' (not an unfinished UTF-8 character that breaks the next
    request); the session reads what the same text sent as UTF-8 reads."""
    sid, twin = client.post("/v1/sessions").json()["id"], client.post("/v1/sessions").json()["id"]
    r = client.post(f"/v1/sessions/{sid}/text", content="Café naïve".encode("latin-1"),
                    headers={"content-type": "text/plain; charset=latin-1"})
    assert r.status_code == 200, r.text
    info = r.json()["session"]
    assert r.json()["tokens"] == 10 and info["pending_bytes"] == 0 and info["chars"] == 10
    same = client.post(f"/v1/sessions/{twin}/text", content="Café naïve".encode(), headers={
        "content-type": "text/plain; charset=utf-8"}).json()
    assert same["nll"] == pytest.approx(r.json()["nll"], abs=1e-6)
    assert client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2}).status_code == 200


def test_the_page_has_no_icon_to_miss(client):
    """The page names an empty icon, and a browser that asks for /favicon.ico anyway gets 204, not a 404."""
    assert '<link rel="icon" href="data:,">' in client.get("/").text
    for method in ("GET", "HEAD"):
        r = client.request(method, "/favicon.ico")
        assert r.status_code == 204 and not r.content
