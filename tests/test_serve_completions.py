"""/v1/completions against word-level models (a txl word run and the Hugging Face transfo-xl layout): the
prompt is whole text, read to its last word (issue 36: the last word was held back as a session holds an
unfinished line, so usage.prompt_tokens was 0 and echo showed 'The history ofthis'')."""

import pytest
import torch

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import loader, make_model_dir, running  # noqa: E402
from test_generate_cli import hf_dir  # noqa: E402,F401 - the fixture: a random transfo-xl in the HF layout

import txl  # noqa: E402
from txl.serve import ServeConfig, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
PROMPTS = {"word": "The cat sat on the", "hf": "the cat sat on a"}


@pytest.fixture(scope="module")
def word_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("serve-word") / "word", level="word")


@pytest.mark.parametrize("kind", ["word", "hf"])
def test_a_completion_reads_its_whole_prompt(kind, request, tmp_path):
    directory = request.getfixturevalue("word_dir" if kind == "word" else "hf_dir")
    load = loader(directory)
    model, tok, _ = load()
    prompt = PROMPTS[kind]
    ids = [int(i) for i in tok.encode_prompt(prompt)]
    context = [] if tok.context_id is None else [int(tok.context_id)]
    assert len(ids) == 5
    # What the prompt's tokens score read in one segment (no memory), and the greedy continuation txl.generate
    # draws from the same tokens.
    x = torch.tensor([context + ids])
    with torch.no_grad():
        want_lps = (-model(x[:, :-1], labels=x[:, 1:], context=model.config.context(ext_len=0)).nll)[0].tolist()
    new = txl.generate(model, context + ids, max_new_tokens=6, temperature=0)[0].tolist()

    app = create_app(ServeConfig(state_dir=str(tmp_path / "state")), load)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True,
                                            "logprobs": 1})
        assert r.status_code == 200, r.text
        out = r.json()
        plain = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    block = out["choices"][0]["logprobs"]
    assert block["tokens"] == [tok.token_text(i) for i in ids + new]
    scored = block["token_logprobs"][:5]
    if not context:  # a document's first token has no context to be scored from
        assert scored[0] is None
        scored, want_lps = scored[1:], want_lps
    assert scored == pytest.approx(want_lps[-len(scored):], abs=1e-5)
    # The text: the prompt, then what the new tokens add to it (a space before a word), as decode joins them.
    text = out["choices"][0]["text"]
    assert text == prompt + plain["choices"][0]["text"]
    assert tok.decode(context + ids + new).endswith(text[len(prompt):])
    assert text[len(prompt):][:1] in (" ", "\n")
