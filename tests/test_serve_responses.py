"""`txl serve`'s response models (``txl.serve.responses``): /openapi.json lists one for every JSON answer and
streamed chunk; every answer of a real server, streamed chunks included, is exactly its model (validated, and
dumped back to the same JSON: nothing dropped or added); and a route that returns a key its model does not declare
fails instead of changing the API silently."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import TEXT, word_model_fixtures  # noqa: E402

from txl.serve import openai, responses  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# path, method -> (status, the model of its JSON answer, the model of its streamed chunks or None)
ROUTES = {
    ("/health", "get"): (200, responses.Health, None),
    ("/v1/models", "get"): (200, responses.ModelList, None),
    ("/v1/models/{model}", "get"): (200, responses.ModelCard, None),
    ("/v1/sessions", "post"): (201, responses.SessionInfo, None),
    ("/v1/sessions/{sid}", "get"): (200, responses.SessionInfo, None),
    ("/v1/sessions/{sid}", "delete"): (200, responses.Deleted, None),
    ("/v1/sessions/{sid}/text", "post"): (200, responses.TextRead, None),
    ("/v1/sessions/{sid}/generate", "post"): (200, responses.Generation, responses.GenerationChunk),
    ("/v1/completions", "post"): (200, responses.Completion, responses.CompletionChunk),
    ("/tokenize", "post"): (200, responses.Tokenized, None),
    ("/detokenize", "post"): (200, responses.Detokenized, None),
    ("/tokenizer_info", "get"): (200, responses.TokenizerInfo, None),
}


word_dir, api = word_model_fixtures("responses")


def ref(schema: dict) -> str:
    return schema["$ref"].rsplit("/", 1)[-1]


def test_openapi_lists_every_answer_and_chunk_model(api):
    spec = api.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for (path, method), (status, model, chunk) in ROUTES.items():
        answers = spec["paths"][path][method]["responses"]
        content = answers[str(status)]["content"]
        assert ref(content["application/json"]["schema"]) == model.__name__, (path, method)
        if chunk is not None:
            assert ref(content["text/event-stream"]["schema"]) == chunk.__name__
        if path != "/health":
            assert ref(answers["400"]["content"]["application/json"]["schema"]) == "ErrorBody"
    assert ref(spec["paths"]["/health"]["get"]["responses"]["503"]["content"]["application/json"]["schema"]) == \
        "Unavailable"
    names = {m.__name__ for _, m, _ in ROUTES.values()} | {c.__name__ for *_, c in ROUTES.values() if c}
    assert names | {"StreamError", "ErrorBody", "SessionInfo", "Logprobs", "Choice", "Usage"} <= set(schemas)
    for name in names:  # each listed as the model says: its fields, and which of them are required
        model = getattr(responses, name)
        assert set(schemas[name]["properties"]) == set(model.model_fields), name
        required = {k for k, f in model.model_fields.items() if f.is_required()}
        assert set(schemas[name].get("required", [])) == required, name


def exactly(model, body: dict) -> None:
    """``body`` is a ``model``: it validates, and dumps back to itself (no key dropped, none added)."""
    assert model.model_validate(body).model_dump(mode="json", exclude_unset=True) == body


def chunks(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]


def test_every_answer_is_its_model(api):
    R = responses
    exactly(R.Health, api.get("/health").json())
    exactly(R.ModelList, api.get("/v1/models").json())
    exactly(R.ModelCard, api.get("/v1/models/tiny").json())
    created = api.post("/v1/sessions")
    assert created.status_code == 201
    exactly(R.SessionInfo, created.json())
    sid = created.json()["id"]
    plain = api.post(f"/v1/sessions/{sid}/text", json={"text": TEXT.splitlines(True)[0]}).json()
    exactly(R.TextRead, plain)
    assert "logprobs" not in plain  # not asked for: absent, as before the models
    scored = api.post(f"/v1/sessions/{sid}/text", json={"text": TEXT.splitlines(True)[1], "logprobs": True}).json()
    exactly(R.TextRead, scored)
    assert scored["logprobs"] and {"token", "logprob"} == set(scored["logprobs"][0])
    exactly(R.SessionInfo, api.get(f"/v1/sessions/{sid}").json())
    gen = api.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, "temperature": 0, "logprobs": True})
    exactly(R.Generation, gen.json())
    streamed = chunks(api.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, "temperature": 0,
                                                                   "stream": True}))
    for c in streamed:
        exactly(R.GenerationChunk, c)
    assert streamed[-1]["finish_reason"] and "session" in streamed[-1] and "session" not in streamed[0]
    done = api.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 3, "temperature": 0, "echo": True,
                                             "logprobs": 2}).json()
    exactly(R.Completion, done)
    assert "session" not in done
    exactly(R.Completion, api.post("/v1/completions", json={"prompt": [[4, 5], [6]], "max_tokens": 2}).json())
    exactly(R.Completion, api.post("/v1/completions", json={"prompt": "A dog", "max_tokens": 2,
                                                            "session": sid}).json())
    streamed = chunks(api.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 3, "temperature": 0,
                                                        "stream": True, "logprobs": 1}))
    for c in streamed:
        exactly(R.CompletionChunk, c)
    assert all("usage" not in c for c in streamed)  # no usage unless stream_options.include_usage asks for it
    streamed = chunks(api.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 3, "temperature": 0,
                                                        "stream": True, "stream_options": {"include_usage": True}}))
    for c in streamed:
        exactly(R.CompletionChunk, c)
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in streamed[:-1])
    exactly(R.Tokenized, api.post("/tokenize", json={"prompt": "The cat", "return_token_strs": True}).json())
    exactly(R.Tokenized, api.post("/tokenize", json={"prompt": "The cat"}).json())
    exactly(R.Detokenized, api.post("/detokenize", json={"tokens": [4, 5]}).json())
    exactly(R.TokenizerInfo, api.get("/tokenizer_info").json())
    exactly(R.ErrorBody, api.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).json())
    exactly(R.Deleted, api.delete(f"/v1/sessions/{sid}").json())


def test_an_undeclared_key_is_refused_not_sent(api, monkeypatch):
    """The models are enforced: a key a route adds that its model lacks makes the answer fail (500) instead of
    reaching clients as an unannounced change of the API."""
    monkeypatch.setattr(openai, "model_card", lambda name: {"id": name, "object": "model", "owned_by": "txl",
                                                            "created": 0, "surprise": 1})
    r = api.get("/v1/models/tiny")
    assert r.status_code == 500 and "surprise" not in r.text


def test_an_undeclared_key_in_a_stream_ends_it_with_an_error_chunk(api, monkeypatch):
    """A streamed chunk that is not its model, after the stream began (its 200 already sent): the stream ends as
    one whose generation fails there does, an error chunk then ``data: [DONE]``, not a connection cut without an
    end."""
    call = openai.Chunks.__call__

    def surprise(self, kind, data):
        chunk = call(self, kind, data)
        return None if chunk is None else {**chunk, "surprise": 1}

    monkeypatch.setattr(openai.Chunks, "__call__", surprise)
    streamed = chunks(api.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 3, "temperature": 0,
                                                        "stream": True}))
    assert streamed == [{"error": {"field": None, "reason": "internal error"}}]


def test_an_answer_that_is_not_its_model_is_a_500_not_an_exception_out_of_the_app():
    """The response model's 500 is answered by its own handler: no exception leaves the app (starlette re-raises
    those it answers as any Exception, and uvicorn then closes the client's keep-alive connection)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from txl.serve.middleware import add_error_handlers

    app = FastAPI()
    add_error_handlers(app)

    @app.get("/card", response_model=responses.Detokenized)
    async def card():
        return {"prompt": "x", "surprise": 1}

    with TestClient(app, raise_server_exceptions=True) as client:  # an exception out of the app would raise here
        r = client.get("/card")
    assert r.status_code == 500 and "surprise" not in r.text
    exactly(responses.ErrorBody, r.json())


def test_an_internal_error_is_a_500_that_keeps_the_connection():
    """Any server bug is answered as a 500 and logged once; the exception does not leave the app (starlette raises
    the errors it answers again, and uvicorn would close a keep-alive client's connection), so a client's next
    request on the same connection is served."""
    import httpx
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from serve_util import running

    from txl.serve.metrics import Metrics
    from txl.serve.middleware import add_error_handlers, guard

    app = FastAPI()
    add_error_handlers(app)
    guard(app, limit=1 << 20, metrics=Metrics())

    @app.get("/bug")
    async def bug():
        raise RuntimeError("a server bug")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    with TestClient(app, raise_server_exceptions=True) as client:  # an exception out of the app would raise here
        r = client.get("/bug")
    assert r.status_code == 500 and "a server bug" not in r.text
    exactly(responses.ErrorBody, r.json())
    with running(app, ready=False) as url, httpx.Client(base_url=url, timeout=30) as client:
        peers = []
        for path in ("/bug", "/fine", "/bug", "/fine"):
            r = client.get(path, extensions={"trace": lambda name, info: peers.append(info.get("stream"))
                                             if name == "connection.connect_tcp.complete" else None})
            assert r.status_code == (500 if path == "/bug" else 200)
        assert len(peers) == 1  # one TCP connection served all four
