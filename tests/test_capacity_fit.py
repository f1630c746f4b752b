"""The adaptive softmax's 'capacity' rows sized from the data a run reads (issue 45 item 4, after WikiText-2 overflowed
the Zipf estimate): ``OrderedIterator.tail_counts`` counts each tail's labels per model call over every batch, exactly
(one process, fixed lengths) or as a bound (several processes, ``var_len``); ``AdaptiveLogSoftmax.fit_capacity`` sets
the rows from them. On a label stream heavier in the first tail than Zipf's law the Zipf rows overflow and the fitted
ones do not: the NLL equals 'selected''s on every batch; ``txl.evaluate`` and ``score_documents`` size the rows from
what they read and equal 'selected'; a training run resolved for CUDA neither stops nor goes NaN; and where rows do
overflow on a device (NaN), the divergence message names them."""

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl.train
from txl.config import ComputeConfig, DataConfig, EvalConfig, RunConfig, TrainConfig
from txl.data import OrderedIterator
from txl.data.corpora import load_run_corpus
from txl.evaluate import evaluate
from txl.model import plan
from txl.model.adaptive import AdaptiveLogSoftmax, cluster_of
from txl.score import score_documents

pytestmark = pytest.mark.usefixtures("one_thread")

CUTOFFS = [200, 600, 1200]


def heavy_stream(n: int, seed: int = 0) -> np.ndarray:
    """(n,) ids of a 2,000-word vocabulary: Zipf-distributed, with a third of them replaced by uniform ids of the
    first tail (200 to 599): about 3x its Zipf share there, as real text runs past it (WikiText-2: 1.14x)."""
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, 2001)
    ids = rng.choice(2000, size=n, p=probs / probs.sum())
    swap = rng.random(n) < 1 / 3
    ids[swap] = rng.integers(200, 600, size=int(swap.sum()))
    return ids


def calls(it: OrderedIterator, chunks: int, epochs: int = 2):
    """Every model call's labels, (B / chunks, C + T) each, over ``epochs`` epochs."""
    for _ in range(epochs):
        for batch in it:
            yield from batch.labels.chunk(chunks)


def most_per_tail(label_sets, cutoffs: list[int]) -> list[int]:
    """The most labels any of ``label_sets`` holds in each tail cluster, counted one by one (bincount)."""
    most = [0] * len(cutoffs)
    for labels in label_sets:
        kept = labels[labels >= 0]
        counts = torch.bincount(cluster_of(kept, cutoffs), minlength=len(cutoffs) + 1)[1:].tolist()
        most = [max(a, b) for a, b in zip(most, counts)]
    return most


@pytest.mark.parametrize("var_len", [False, True])
@pytest.mark.parametrize("world_size, chunks", [(1, 1), (1, 2), (2, 2)])
def test_tail_counts_are_the_worst_calls_counts_or_a_bound(var_len, world_size, chunks):
    """One process at a fixed length: exactly the most any call holds (with context carried, ext_len 3, whose labels
    are ignored). Several processes: every rank the same, the most of any rank's. ``var_len``: a bound."""
    tokens = heavy_stream(20_003)
    per_rank = []
    for rank in range(world_size):
        it = OrderedIterator(tokens, batch_size=8, tgt_len=24, ext_len=3, var_len=var_len, seed=1, rank=rank,
                             world_size=world_size)
        counted = it.tail_counts(CUTOFFS, chunks)
        per_rank.append((counted, most_per_tail(calls(it, chunks), CUTOFFS)))
    assert all(counted == per_rank[0][0] for counted, _ in per_rank)
    worst = [max(seen[i] for _, seen in per_rank) for i in range(len(CUTOFFS))]
    if var_len:
        assert all(c >= w for c, w in zip(per_rank[0][0], worst)), (per_rank[0][0], worst)
    else:
        assert per_rank[0][0] == worst


def softmax(rows: str) -> AdaptiveLogSoftmax:
    torch.manual_seed(0)
    module = AdaptiveLogSoftmax(tiny_config(vocab_size=2000, cutoffs=CUTOFFS))
    for p in module.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    module.rows = rows  # as the model's plan sets it
    return module


def test_fitted_rows_cover_every_batch_where_zipfs_overflow_and_equal_selected():
    """16 streams of 48 labels (768 a call): the first tail's Zipf rows are fewer than the worst call's labels (the
    input check names the overflow); fitted from the batches, the rows (the counts rounded up to 8s) hold every
    call, whose NLL equals 'selected''s bit for bit."""
    it = OrderedIterator(heavy_stream(16 * 200 + 1), batch_size=16, tgt_len=48)
    counts, batches = it.tail_counts(CUTOFFS), list(calls(it, 1, epochs=1))
    capacity, selected = softmax("capacity"), softmax("selected")
    zipf_rows = capacity.capacities(16 * 48)
    assert counts[0] > zipf_rows[0], (counts, zipf_rows)  # Zipf's rows would overflow
    worst = next(labels for labels in batches if most_per_tail([labels], CUTOFFS)[0] > zipf_rows[0])
    with pytest.raises(ValueError, match=r"tail cluster 1 .*more than its \d+ cluster_rows='capacity' rows"):
        capacity.check_rows(worst)
    capacity.fit_capacity(counts)
    assert capacity.caps == capacity.capacities(16 * 48)
    assert all(c % 8 == 0 and k <= c < k + 8 for c, k in zip(capacity.caps, counts)), (capacity.caps, counts)
    hidden = torch.randn(16 * 48, 32)
    for labels in batches:
        capacity.check_rows(labels)  # no overflow
        h = hidden[:labels.numel()]  # (N, d): the last segment is shorter
        got = capacity.nll(h, labels.reshape(-1))
        assert not got.isnan().any()
        torch.testing.assert_close(got, selected.nll(h, labels.reshape(-1)), rtol=0, atol=0)


def test_fitted_rows_only_grow_and_take_one_count_per_tail():
    module = softmax("capacity")
    module.fit_capacity([100, 3, 0])
    assert module.caps == [104, 8, 8]  # rounded up to 8s, at least 8 (an empty tail scores 8 rows, never read)
    module.fit_capacity([40, 17, 0])  # another split: its counts where larger
    assert module.caps == [104, 24, 8] and module.capacities(50) == [50, 24, 8]
    with pytest.raises(ValueError):
        module.fit_capacity([1, 2])


def test_evaluate_sizes_the_rows_from_its_split():
    """``txl.evaluate`` (``txl eval``, validation) over a split the Zipf rows overflow: it sizes the rows from the
    split's batches first (the host check passes) and its loss is 'selected''s."""
    config = tiny_config(vocab_size=2000, cutoffs=CUTOFFS)
    torch.manual_seed(0)
    selected = txl.TransformerXL(config)
    capacity = txl.TransformerXL(config, plan.resolve(ComputeConfig(), "cuda"))
    capacity.load_state_dict(selected.state_dict())
    tokens = heavy_stream(12 * 100 + 1, seed=3)
    counts = OrderedIterator(tokens, batch_size=12, tgt_len=64).tail_counts(CUTOFFS)
    assert counts[0] > capacity.softmax.capacities(12 * 64)[0]  # Zipf's rows overflow on this split
    kwargs = dict(metric="ppl", batch_size=12, tgt_len=64)
    got, want = evaluate(capacity, tokens, **kwargs), evaluate(selected, tokens, **kwargs)
    assert capacity.softmax.caps == [8 * -(-c // 8) for c in counts]
    assert got.tokens == want.tokens and got.loss == pytest.approx(want.loss, rel=1e-6)


@pytest.mark.parametrize("context_id", [None, 0])
def test_scored_documents_size_the_rows_and_score_as_selected(monkeypatch, context_id):
    """``score_documents`` over documents of known length (lists) sizes the rows from their segments: where the
    Zipf rows would overflow (checked on the host), every score equals 'selected''s, none NaN, as on a device (no
    host check)."""
    config = tiny_config(vocab_size=2000, cutoffs=CUTOFFS)
    torch.manual_seed(0)
    selected = txl.TransformerXL(config)
    capacity = txl.TransformerXL(config, plan.resolve(ComputeConfig(), "cuda"))
    capacity.load_state_dict(selected.state_dict())
    stream = heavy_stream(6 * 300, seed=2)
    docs = [stream[300 * i:300 * i + 100 + 40 * i].tolist() for i in range(6)]  # 100 to 300 ids each
    n = 6 * 64  # the labels of one segment of the six documents read together
    zipf_rows = capacity.softmax.capacities(n)
    assert capacity.softmax.caps is None
    monkeypatch.setattr("txl.model.transformer.reads_values", lambda t: False)  # as on a device: no host check
    kwargs = dict(segment_len=64, batch_size=6, mem_len=16, context_id=context_id, keep_logprobs=True)
    got, want = score_documents(capacity, docs, **kwargs), score_documents(selected, docs, **kwargs)
    # Both multiples of 8: rows above Zipf's mean a segment held more labels than Zipf's rows (an overflow).
    assert capacity.softmax.caps[0] > zipf_rows[0], (capacity.softmax.caps, zipf_rows)
    for a, b in zip(got, want, strict=True):
        assert np.isfinite(a.logprobs).all()
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)


def run_config(corpus: str, out) -> RunConfig:
    """A tiny byte-level model of the code corpus (a third of its bytes in the first tail, 64 to 127: 3x Zipf's
    share), resolved as CUDA resolves it ('capacity' rows), 16 streams of 32 (512 labels a step), on the CPU."""
    model, compute = tiny_config(vocab_size=256, cutoffs=[64, 128]), plan.resolve(ComputeConfig(), "cuda")
    return RunConfig(data=DataConfig(corpus=corpus, level="byte"), model=model, compute=compute,
                     eval=EvalConfig(batch_size=2),
                     train=TrainConfig(out_dir=str(out), max_steps=3, batch_size=16, tgt_len=32, progress=False,
                                       tensorboard=False, plot=False, eval_batches=2, eval_interval=0, log_interval=1,
                                       device="cpu", precision="fp32", sample_tokens=0))


def test_a_run_resolved_for_cuda_sizes_its_rows_from_its_batches(corpus, tmp_path, monkeypatch):
    """Zipf's rows would stop the run (the host's check) or, on a device where nothing is read back, give a NaN loss,
    which the divergence message then names; sized from the run's batches, it trains and tests with finite losses."""
    cfg = run_config(corpus, tmp_path / "fitted")
    assert cfg.compute.cluster_rows == "capacity"
    data = load_run_corpus(cfg.data)
    it = OrderedIterator(data.train, batch_size=16, tgt_len=32)
    zipf_rows = AdaptiveLogSoftmax(cfg.model).capacities(16 * 32)
    assert it.tail_counts([64, 128])[0] > zipf_rows[0]  # the Zipf rows overflow on this corpus
    result = txl.train.train(cfg, corpus=data)
    assert result.steps == 3 and np.isfinite(result.valid.loss) and np.isfinite(result.test.loss)

    monkeypatch.setattr(txl.train, "fit_capacity", lambda *a, **k: None)  # the Zipf estimate, as before
    with pytest.raises(ValueError, match=r"tail cluster 1 .*--compute.cluster_rows all \(eagerly: selected\)"):
        txl.train.train(run_config(corpus, tmp_path / "zipf"), corpus=data)
    monkeypatch.setattr("txl.model.transformer.reads_values", lambda t: False)  # as on a device: no host check
    with pytest.raises(txl.train.TrainingError, match=r"loss is nan at step 1.*cluster_rows='capacity' rows: use "
                                                      r"--compute.cluster_rows all, or selected eagerly"):
        txl.train.train(run_config(corpus, tmp_path / "device"), corpus=data)
