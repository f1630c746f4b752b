"""`txl serve` as clients of OpenAI, vLLM and llama.cpp servers expect it: every request field of OpenAI's
completions spec accepted or refused with a reason (the table is checked against the official client's list
of fields), nulls where the spec allows them, token-id and batched prompts, dict top_logprobs for echoed
prompt tokens, logprobs in every streamed chunk, /tokenize, /detokenize, /tokenizer_info, a served model
name, HEAD wherever GET is allowed, and CORS off unless configured."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import loader, running, word_model_fixtures  # noqa: E402

from txl.serve import ServeConfig, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
C = "/v1/completions"


word_dir, api = word_model_fixtures("openai")


# -- the spec's request fields ---------------------------------------------------------------------------------
OK = 200
SPEC = [  # (field, value, status, what the answer says: the reason of a refusal, or None)
    ("model", "tiny", OK, None), ("model", None, OK, None),
    ("model", "gpt-3.5-turbo-instruct", 404, "no model 'gpt-3.5-turbo-instruct' here: this server serves 'tiny'"),
    ("prompt", "The cat", OK, None), ("prompt", ["The cat", "A dog"], OK, None), ("prompt", [4, 5, 6], OK, None),
    ("prompt", [[4, 5], [6, 7, 8]], OK, None),
    ("prompt", None, 400, "is empty: give a text to continue (or a session)"),
    ("prompt", [], 400, "is an empty list"), ("prompt", [[4], []], 400, "holds an empty list of token ids"),
    ("prompt", [4, 99999], 400, "token id 99999 is out of range"), ("prompt", ["a"] * 5, 400, "at most 4 prompts"),
    ("prompt", 5, 422, None), ("prompt", ["a", 5], 422, None),
    ("best_of", 1, OK, None), ("best_of", None, OK, None), ("best_of", 2, 400, "only 1 is supported"),
    ("echo", True, OK, None), ("echo", None, OK, None), ("echo", "yes", 422, None),
    ("frequency_penalty", 0, OK, None), ("frequency_penalty", None, OK, None),
    ("frequency_penalty", 0.5, 400, "is not supported (only 0)"),
    ("logit_bias", {}, OK, None), ("logit_bias", None, OK, None), ("logit_bias", {"5": 1.0}, 400, "is not supported"),
    ("logprobs", 2, OK, None), ("logprobs", 0, OK, None), ("logprobs", None, OK, None),
    ("logprobs", 6, 400, "must be in 0..5"),
    ("max_tokens", 3, OK, None), ("max_tokens", None, OK, None), ("max_tokens", -1, 400, "must be >= 0"),
    ("n", 1, OK, None), ("n", None, OK, None), ("n", 2, 400, "only 1 is supported"),
    ("presence_penalty", 0, OK, None), ("presence_penalty", None, OK, None),
    ("presence_penalty", 1.0, 400, "is not supported (only 0)"),
    ("seed", 7, OK, None), ("seed", None, OK, None), ("seed", -1, 400, "must be in 0..2**63-1"),
    ("stop", "\n", OK, None), ("stop", ["cat", "dog"], OK, None), ("stop", None, OK, None),
    ("stop", list("abcde"), 400, "at most 4 stop texts"),
    ("stream", True, OK, None), ("stream", None, OK, None), ("stream", "yes", 422, None),
    ("stream_options", {"include_usage": True}, OK, None), ("stream_options", None, OK, None),
    ("suffix", "", OK, None), ("suffix", None, OK, None), ("suffix", " the end", 400, "is not supported"),
    ("temperature", 0, OK, None), ("temperature", None, OK, None), ("temperature", -1, 400, "must be >= 0"),
    ("top_p", 0.9, OK, None), ("top_p", None, OK, None), ("top_p", 0, 400, "must be in (0, 1]"),
    ("user", "u-1", OK, None), ("user", None, OK, None), ("user", 5, 422, None),
]


def test_the_table_covers_every_field_of_the_spec():
    """The fields of OpenAI's CreateCompletionRequest, as the official client (generated from the spec) lists
    them; each has a row accepting a value, a row sending null, and a refusal where the field can be wrong."""
    from openai.types import completion_create_params as params

    spec = set(params.CompletionCreateParamsNonStreaming.__annotations__)
    assert {field for field, *_ in SPEC} == spec
    for field in spec:
        rows = [(value, status) for f, value, status, _ in SPEC if f == field]
        assert any(v is None for v, _ in rows) and any(s == OK and v is not None for v, s in rows), field


@pytest.mark.parametrize("field,value,status,reason", SPEC,
                         ids=[f"{f}={json.dumps(v)[:24]}" for f, v, *_ in SPEC])
def test_spec_field(api, field, value, status, reason):
    body = {"prompt": "The cat", "max_tokens": 2, "seed": 0, field: value}
    r = api.post(C, json=body)
    assert r.status_code == status, r.text
    if status != OK:
        error = r.json()["error"]
        assert error["field"].split(".")[0] == field and (reason is None or reason in error["reason"]), error
        return
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] and r.text.rstrip().endswith("[DONE]")
        return
    out = r.json()
    n_prompts = len(value) if field == "prompt" and isinstance(value, list) and not isinstance(value[0], int) else 1
    assert [c["index"] for c in out["choices"]] == list(range(n_prompts)) and out["model"] == "tiny"
    want = {"max_tokens": 16}.get(field, 2) if value is None else (value if field == "max_tokens" else 2)
    assert all(c["finish_reason"] in ("length", "stop") for c in out["choices"])
    assert out["usage"]["completion_tokens"] <= want * n_prompts


# -- prompts ------------------------------------------------------------------------------------------------------
def test_token_id_and_batched_prompts_equal_one_text_prompt_each(api, word_dir):
    """A text prompt is read after the tokenizer's context token (<eos>); the same tokens sent as ids with that
    token first give the same log-probs and the same greedy continuation; a batch answers each prompt as alone."""
    from txl.data.tokenizer import load_model_tokenizer

    tok = load_model_tokenizer(word_dir)
    texts = ["The cat sat on the", "A dog ran to"]
    common = {"max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    alone = [api.post(C, json={"prompt": t, **common}).json()["choices"][0] for t in texts]
    ids = [[tok.prefix_id] + tok.encode_prompt(t) for t in texts]
    for batch in (texts, ids):
        got = api.post(C, json={"prompt": batch, **common}).json()["choices"]
        assert [c["index"] for c in got] == [0, 1]
        for a, b in zip(alone, got):
            offset = 1 if isinstance(batch[0], list) else 0  # the ids' own first token: the prefix, unscored
            assert b["logprobs"]["token_logprobs"][0] is None if offset else True
            assert b["logprobs"]["tokens"][offset:] == a["logprobs"]["tokens"]
            assert b["logprobs"]["token_logprobs"][offset:] == pytest.approx(a["logprobs"]["token_logprobs"],
                                                                             abs=1e-5)
            assert b["text"].endswith(a["text"][len(texts[0] if a is alone[0] else texts[1]):])


def test_echoed_prompt_tokens_have_dict_top_logprobs(api, word_dir):
    """Each echoed prompt token after the first has a dict: the model's `logprobs` most likely next tokens (as
    the model's full distribution ranks them) and the token itself, with exactly its token_logprobs value (so
    lm-eval's greedy check, token == max(dict), holds for the argmax)."""
    import txl
    from txl.data.tokenizer import load_model_tokenizer

    tok = load_model_tokenizer(word_dir)
    model = txl.from_pretrained(word_dir)
    ids = [tok.prefix_id] + tok.encode_prompt("The cat sat on the mat. A dog ran to the red house; it was big.")
    r = api.post(C, json={"prompt": ids, "max_tokens": 0, "logprobs": 2, "echo": True}).json()
    block = r["choices"][0]["logprobs"]
    assert block["top_logprobs"][0] is None and len(block["top_logprobs"]) == len(ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        full = model(x[:, :-1], context=model.config.context(ext_len=0)).log_probs[0]  # (T, V): one segment
    for t, (token, lp, top) in enumerate(zip(block["tokens"][1:], block["token_logprobs"][1:],
                                             block["top_logprobs"][1:])):
        values, best = full[t].topk(2)
        assert isinstance(top, dict) and top[token] == lp and 2 <= len(top) <= 3
        for v, i in zip(values.tolist(), best.tolist()):
            assert top[tok.token_text(i)] == pytest.approx(v, abs=1e-4)
        assert (max(top.values()) == lp) == (int(full[t].argmax()) == ids[t + 1])


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_chunks_each_carry_their_tokens_logprobs(api, echo):
    """Every chunk with text has the logprobs of the tokens it completes (the echoed prompt's first); together
    they are the whole answer's, offsets included."""
    body = {"prompt": "The cat", "max_tokens": 8, "seed": 3, "temperature": 0.9, "logprobs": 1, "echo": echo}
    whole = api.post(C, json=body).json()["choices"][0]
    r = api.post(C, json={**body, "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in r.text.split("\n\n") if line.startswith("data: {")]
    texts = [c for c in chunks if c["text"]]
    assert texts and all(c["logprobs"] and c["logprobs"]["tokens"] for c in texts)  # every text chunk
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    lps = [x for c in chunks for x in c["logprobs"]["token_logprobs"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert tokens == whole["logprobs"]["tokens"] and lps == pytest.approx(whole["logprobs"]["token_logprobs"])
    offsets = [x for c in chunks for x in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    tops = [x for c in chunks for x in c["logprobs"]["top_logprobs"]]
    assert len(tops) == len(whole["logprobs"]["top_logprobs"])
    for a, b in zip(tops, whole["logprobs"]["top_logprobs"]):
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b))


def test_word_level_text_offsets_are_positions_in_the_text(api):
    """text_offset is where each token's piece of the choice's text starts (a word owning the space before it,
    ``<eos>`` the line break), in the prompt as written (two spaces, a line break) and in the generated text
    after it; not a running sum of the tokens' lengths ([0, 3, 6, 9, 14, ...] here)."""
    prompt = "The  cat sat\non the mat."
    r = api.post(C, json={"prompt": prompt, "max_tokens": 6, "seed": 1, "logprobs": 0, "echo": True}).json()
    choice = r["choices"][0]
    block, text = choice["logprobs"], choice["text"]
    assert block["text_offset"][:7] == [0, 3, 8, 12, 13, 15, 19]
    ends = block["text_offset"][1:] + [len(text)]
    for token, start, end in zip(block["tokens"], block["text_offset"], ends):
        assert text[start:end].strip(" ") == ("\n" if token == "<eos>" else token), (token, text[start:end])
    streamed = api.post(C, json={"prompt": prompt, "max_tokens": 6, "seed": 1, "logprobs": 0, "echo": True,
                                 "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    assert [x for c in chunks for x in c["logprobs"]["text_offset"]] == block["text_offset"]


def test_token_starts_of_words():
    from txl.serve.openai import token_starts

    assert token_starts("to hello , the cat", ["to", "hello", ",", "the", "cat"], words=True) == [0, 2, 8, 10, 14]
    # <unk> and a lower-cased word stand for the word there; <eos> for the line break; WikiText's @-@ for "-".
    assert token_starts("A Zyx\nwell-known", ["a", "<unk>", "<eos>", "well", "@-@", "known"], words=True,
                        eos="<eos>") == [0, 1, 5, 6, 10, 11]
    assert token_starts("ab", ["a", "b"], words=False) == [0, 1]


def test_streamed_usage_comes_in_a_last_chunk_of_its_own(api):
    """stream_options.include_usage, read by the openai client: the usage in a last chunk with ``choices: []``,
    every other chunk's usage None; without it no chunk has a usage (as OpenAI streams)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(api.base_url) + "/v1", api_key="unused", max_retries=0)
    asked = dict(model="tiny", prompt="The cat", max_tokens=5, seed=2, temperature=0.8, stream=True)
    chunks = list(client.completions.create(**asked, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.total_tokens == 7
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    plain = list(client.completions.create(**asked))
    assert all(c.usage is None and len(c.choices) == 1 for c in plain)
    assert "".join(c.choices[0].text for c in plain) == "".join(c.choices[0].text for c in chunks[:-1])
    with pytest.raises(openai.UnprocessableEntityError):  # a misspelt option is named, not ignored
        client.completions.create(**asked, stream_options={"include_usages": True})


# -- the tokenizer, the model's name, HEAD, CORS -----------------------------------------------------------------
def test_tokenize_detokenize_and_tokenizer_info(api, word_dir):
    from txl.data.tokenizer import load_model_tokenizer

    tok = load_model_tokenizer(word_dir)
    text = "The cat sat on the mat.\nA dog"
    r = api.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode_prompt(text) and r["count"] == len(r["tokens"])
    assert r["token_strs"] == [tok.token_text(i) for i in r["tokens"]]
    assert api.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    info = api.get("/tokenizer_info").json()
    assert info["eos_token"] == "<eos>" and info["eos_token_id"] == tok.prefix_id == tok.context_id
    assert api.post("/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"] == [info["eos_token_id"]]
    assert info["bos_token"] is None and info["vocab_size"] == tok.vocab_size
    bad = api.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "tokens.1"
    assert api.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    assert api.post("/tokenize", json={"text": "x"}).json()["error"]["field"] == "text"  # unknown field, 422


def test_served_model_name(word_dir, tmp_path):
    app = create_app(ServeConfig(state_dir=str(tmp_path), model_name="org/txl-wt2", durability="shutdown"),
                     loader(word_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["org/txl-wt2"]
        assert c.get("/v1/models/org/txl-wt2").json()["id"] == "org/txl-wt2"
        missing = c.get("/v1/models/tiny")
        assert missing.status_code == 404 and missing.json()["error"]["reason"] == (
            "no model 'tiny' here: this server serves 'org/txl-wt2'")
        r = c.post(C, json={"model": "org/txl-wt2", "prompt": "The cat", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "org/txl-wt2"
        assert c.get("/health").json()["model"] == "org/txl-wt2"


def test_head_wherever_get_is_allowed(api):
    sid = api.post("/v1/sessions").json()["id"]
    for path in ("/", "/health", "/metrics", "/v1/models", "/v1/models/tiny", "/tokenizer_info", f"/v1/sessions/{sid}"):
        get, head = api.get(path), api.head(path)
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert api.head(C).status_code == 405  # POST only: HEAD is not a GET there


def test_cors_is_off_by_default_and_configurable(word_dir, tmp_path):
    preflight = {"Origin": "https://notebook.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    for origins in ("", "https://notebook.example"):
        app = create_app(ServeConfig(state_dir=str(tmp_path / (origins[8:] or "off")), cors_origins=origins,
                                     durability="shutdown"), loader(word_dir))
        with running(app) as url, httpx.Client(base_url=url, timeout=60) as c:
            r = c.options(C, headers=preflight)
            got = c.get("/v1/models", headers={"Origin": "https://notebook.example"})
            other = c.get("/v1/models", headers={"Origin": "https://evil.example"})
            if not origins:  # no CORS: a preflight is a method this route does not take, and nothing is allowed
                assert r.status_code == 405 and "access-control-allow-origin" not in got.headers
            else:
                assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origins
                assert "authorization" in r.headers["access-control-allow-headers"].lower()
                assert got.headers["access-control-allow-origin"] == origins
            assert "access-control-allow-origin" not in other.headers
