"""A pipelined generation (``Requests.pipelined``): step t + 1 is launched before the host reads step t's token.

* the order, from an instrumented runner (every drawn batch numbered as the runner makes it, every host read of one
  logged), not from timing: the launch of step t + 1 comes before the read of step t's token; a stop text or stop
  token leaves exactly one step launched and never read, a token limit none; the unpipelined reference reads first;
* what the client and the session get equals the unpipelined reference exactly (greedy and seeded; stop texts, stop
  tokens, token limits; eager steps and the static-buffer step): the tokens, their log-probs, the streamed pieces and
  per-token calls, the session's memory, counts and score, and the rows kept for the next generation, from which
  the next generation steps on alike;
* rows stepping together, one stopping early: the others generate what they do unpipelined.
"""

import itertools

import pytest
import torch
from serve_util import loader, make_model_dir

from txl.serve.engine import Engine, Model
from txl.serve.runner import Drawn
from txl.serve.session import SessionState, SessionStore

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The cat sat"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return loader(make_model_dir(tmp_path_factory.mktemp("pipelined") / "char"))()


def engine_of(loaded, tmp_path, *, pipelined: bool, graphs: str, segment_len: int) -> Engine:
    model, tokenizer, _ = loaded
    m = Model(model, segment_len=segment_len, mem_len=8, same_length=False, clamp_len=0, graphs=graphs)
    return Engine(m, tokenizer, SessionStore(tmp_path / f"s{pipelined}", max_in_memory=4, ttl=60), max_queue=4,
                  max_batch=4, durable=False, pipelined=pipelined)


class NotCancelled:
    cancelled = False


def drive(engine: Engine, works: list) -> list:
    """Run jobs' generators of units as the scheduler does (units of the same kind and length together, the group
    first made ready first), without its thread; their results."""
    units = {i: next(w) for i, w in enumerate(works)}
    ready = dict.fromkeys(units, 0)
    out: list = [None] * len(works)
    clock = 0
    while units:
        first = min(units, key=lambda i: (ready[i], i))
        group = [i for i in sorted(units) if units[i].key == units[first].key]
        results = engine.m.run(units[first].kind, [units[i] for i in group])
        clock += 1
        for i, r in zip(group, results):
            try:
                units[i], ready[i] = works[i].send(r), clock
            except StopIteration as stop:
                out[i] = stop.value
                del units[i]
    return out


def session(engine: Engine, text: str = PROMPT) -> SessionState:
    state = SessionState(id="", tokens=list(engine.context_ids))
    drive(engine, [engine.read_ids(state, [int(i) for i in engine.tokenizer.encode_prompt(text)])])
    return state


def generate(engine: Engine, state: SessionState, **kw) -> tuple[dict, list, list]:
    """One streamed generation: its result, the streamed pieces, the per-token calls."""
    pieces, calls = [], []
    kw = dict(max_tokens=12, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=[], job=NotCancelled()) | kw
    [out] = drive(engine, [engine.generate(state, on_text=pieces.append, on_token=lambda *a: calls.append(a), **kw)])
    return out, pieces, calls


@pytest.fixture
def instrumented(monkeypatch):
    """The runner's drawn batches numbered as they are made (a step's launch: its kernels are queued before its
    ``Drawn`` is made) and the host's reads of them, in one log: ('launch', n) and ('read', n)."""
    log: list[tuple[str, int]] = []
    numbers = itertools.count()
    init, get = Drawn.__init__, Drawn.get

    def launched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.number = next(numbers)
        log.append(("launch", self.number))

    def read(self, b):
        log.append(("read", self.number))
        return get(self, b)

    monkeypatch.setattr(Drawn, "__init__", launched)
    monkeypatch.setattr(Drawn, "get", read)
    return log


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("rule", ["stop text", "token limit"])
def test_the_next_step_is_launched_before_the_host_reads_this_ones_token(loaded, tmp_path, instrumented, rule,
                                                                         pipelined):
    """Pipelined: step n + 1 launched before the first read of step n's token, for every step but the last; a stop
    text ending the generation before its limit leaves one step launched and never read (dropped), the limit none.
    Unpipelined (the reference, and the control that the log can tell): every token read before the next launch."""
    engine = engine_of(loaded, tmp_path, pipelined=pipelined, graphs="off", segment_len=64)
    free, _, _ = generate(engine, session(engine))
    stop = [free["text"][5:7]] if rule == "stop text" else []
    instrumented.clear()
    out, _, _ = generate(engine, session(engine), stop=stop)
    first = instrumented[0][1]  # reading the prompt draws nothing: the log is the generation's
    generation = [(what, n - first) for what, n in instrumented]
    launches = [n for what, n in generation if what == "launch"]
    reads = sorted({n for what, n in generation if what == "read"})
    assert launches == list(range(len(launches)))
    assert reads == list(range(len(out["ids"])))  # every token the client gets is read, once per row batch
    for n in reads:
        at = generation.index(("read", n))
        if pipelined and n + 1 < len(launches):
            assert generation.index(("launch", n + 1)) < at
        elif not pipelined:
            assert ("launch", n + 1) not in generation[:at]
    dropped = len(launches) - len(reads)
    if rule == "stop text":
        assert out["finish_reason"] == "stop" and len(out["ids"]) < 12
        assert dropped == (1 if pipelined else 0)
    else:
        assert out["finish_reason"] == "length" and len(out["ids"]) == 12 and dropped == 0


def assert_sessions_equal(a: SessionState, b: SessionState) -> None:
    assert (a.tokens, a.n_tokens, a.n_scored, a.nll, a.chars, a.generated) == (
        b.tokens, b.n_tokens, b.n_scored, b.nll, b.chars, b.generated)
    assert (a.memory is None) == (b.memory is None)
    if a.memory is not None:
        assert torch.equal(a.memory, b.memory)
    assert (a.generation is None) == (b.generation is None)
    if a.generation is not None:
        ka, kb = a.generation, b.generation
        assert (ka.inputs, ka.n_tokens, ka.memory.shape) == (kb.inputs, kb.n_tokens, kb.memory.shape)
        assert torch.equal(ka.memory, kb.memory)
        assert (ka.kv is None) == (kb.kv is None)
        if ka.kv is not None:
            assert all(torch.equal(x, y) for x, y in zip(ka.kv, kb.kv))


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("rule, segment_len", [("stop text", 64), ("stop token", 64), ("token limit", 64),
                                               ("stop text", 16)])
def test_a_pipelined_generation_leaves_what_an_unpipelined_one_leaves(loaded, tmp_path, graphs, seed, rule,
                                                                      segment_len):
    """The same tokens, log-probs, text, streamed pieces and per-token calls as the unpipelined reference, bit for
    bit; the session after it equal too (memory, counts, score, and the rows kept for the next generation: the
    dropped step's row is not among them); the next generation then steps on from those rows in both and generates
    the same. Segments of 64 keep every token in the unfinished segment (the rows are kept); of 16, the segment ends
    while generating and its memory comes from the generation's rows."""
    sampling = dict(temperature=0.0 if seed is None else 1.0, seed=seed)
    probe = engine_of(loaded, tmp_path, pipelined=False, graphs=graphs, segment_len=segment_len)
    free, _, _ = generate(probe, session(probe), **sampling)  # where the stop rules stop it: after a few tokens
    # Two fresh engines: the static step's ring is where it was left, and another column rounds otherwise.
    engines = [engine_of(loaded, tmp_path, pipelined=p, graphs=graphs, segment_len=segment_len) for p in (True, False)]
    rule_kw = {"stop text": dict(stop=[free["text"][5:10]]), "stop token": dict(stop_tokens=[free["ids"][6]]),
               "token limit": dict(max_tokens=9)}[rule]
    runs, states = [], []
    for engine in engines:
        state = session(engine)
        runs.append(generate(engine, state, **sampling, **rule_kw))
        states.append(state)
    (a, pieces_a, calls_a), (b, pieces_b, calls_b) = runs
    assert a == b and pieces_a == pieces_b and calls_a == calls_b
    assert a["finish_reason"] == ("length" if rule == "token limit" else "stop") and 0 < len(a["ids"]) < 12
    assert_sessions_equal(*states)
    assert (states[0].generation is None) == (segment_len == 16)  # kept: the next generation steps on from its rows
    kinds = [[], []]
    for engine, state, k in zip(engines, states, kinds):
        run = engine.m.run
        engine.m.run = lambda kind, units, run=run, k=k: (k.append(kind), run(kind, units))[1]
        runs.append(generate(engine, state, max_tokens=5, **sampling))
    assert runs[2][0]["ids"] == runs[3][0]["ids"] and runs[2][1] == runs[3][1]
    torch.testing.assert_close(runs[2][0]["logprobs"], runs[3][0]["logprobs"], atol=1e-6, rtol=0)
    assert kinds[0] == kinds[1] and kinds[0][0] == ("step" if segment_len == 64 else "prefill")


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_rows_stepping_together_one_stopping_early(loaded, tmp_path, graphs):
    """Three sessions' generations batched; one ends at a stop text after a few tokens (pipelined: its dropped step
    ran with the others' steps): each generates what it generates unpipelined, and each session ends alike (the
    rows of different batch sizes: log-probs and memories within float tolerance)."""
    prompts = [PROMPT, "A dog ran", "it was big"]
    probe = engine_of(loaded, tmp_path, pipelined=False, graphs=graphs, segment_len=64)
    stop = [generate(probe, session(probe))[0]["text"][3:5]]  # what the first generation shows after a few tokens
    results, sessions = [], []
    for pipelined in (True, False):
        engine = engine_of(loaded, tmp_path, pipelined=pipelined, graphs=graphs, segment_len=64)
        states = [session(engine, p) for p in prompts]
        works = [engine.generate(s, max_tokens=12, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                                 stop=stop if i == 0 else [], job=NotCancelled(), on_text=lambda piece: None)
                 for i, s in enumerate(states)]
        results.append(drive(engine, works))
        sessions.append(states)
    assert results[0][0]["finish_reason"] == "stop" and len(results[0][0]["ids"]) < 12
    for a, b, sa, sb in zip(*results, *sessions):
        assert a["ids"] == b["ids"] and a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
        torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
        assert sa.tokens == sb.tokens and sa.generation.inputs == sb.generation.inputs
        torch.testing.assert_close(sa.generation.memory, sb.generation.memory, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sa.generation.kv, sb.generation.kv, atol=1e-5, rtol=1e-5)
