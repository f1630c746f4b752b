"""train.loss_positions: the paper's 'Full' and 'Half' losses (Dai et al. 2019, Table 6; Al-Rfou et al. 2018)."""

import pytest
import torch
from conftest import tiny_config

from txl.config import TrainConfig
from txl.data import Batch
from txl.model import TransformerXL
from txl.train import IGNORE_INDEX, DistInfo, loss_labels, train_step

V, B, C, T = tiny_config().vocab_size, 3, 2, 7  # vocab, streams, carried context, segment


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, C + T), generator=g)  # (B, C + T)
    y = torch.randint(0, V, (B, C + T), generator=g)
    y[:, :C] = IGNORE_INDEX  # the iterator's carried context is never scored
    return Batch(input_ids=x, labels=y, context_len=C, start=0)


def _model() -> TransformerXL:
    torch.manual_seed(0)
    return TransformerXL(tiny_config())


def test_last_half_ignores_context_and_first_half_of_segment():
    batch = _batch()
    assert loss_labels(batch, "all") is batch.labels
    half = loss_labels(batch, "last_half")
    first = C + T // 2  # 2 context + 3 of the 7 segment positions ignored; the last 4 scored
    assert (half[:, :first] == IGNORE_INDEX).all()
    assert torch.equal(half[:, first:], batch.labels[:, first:])
    assert (batch.labels[:, C:] != IGNORE_INDEX).all()  # the batch itself is not modified


def test_half_loss_is_the_mean_nll_of_the_last_half_and_first_half_targets_send_no_gradient():
    model, batch = _model(), _batch()
    full = model(batch.input_ids, labels=batch.labels)
    half = model(batch.input_ids, labels=loss_labels(batch, "last_half"))
    first = C + T // 2
    torch.testing.assert_close(half.loss, full.nll[:, first:].mean())
    torch.testing.assert_close(half.nll[:, first:], full.nll[:, first:])

    def grads(labels: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(batch.input_ids, labels=labels).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    base = grads(loss_labels(batch, "last_half"))
    other_first = batch.labels.clone()
    other_first[:, C:first] = (other_first[:, C:first] + 1) % V  # other targets in the ignored half only
    for a, b in zip(base, grads(loss_labels(Batch(batch.input_ids, other_first, C, 0), "last_half")), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other_last = batch.labels.clone()
    other_last[:, -1] = (other_last[:, -1] + 1) % V  # a scored target does change the gradient
    changed = grads(loss_labels(Batch(batch.input_ids, other_last, C, 0), "last_half"))
    assert any(not torch.equal(a, b) for a, b in zip(base, changed, strict=True))


@pytest.mark.parametrize("chunks", [1, 3])
def test_train_step_reports_and_optimises_the_half_loss(chunks):
    """The step's loss is the mean NLL of the last halves, over all accumulation chunks, and its update is
    the one a plain SGD step on that loss makes."""
    model, batch = _model(), _batch(1)
    with torch.no_grad():
        expected = model(batch.input_ids, labels=batch.labels).nll[:, C + T // 2:].mean()
    reference = _model()
    reference(batch.input_ids, labels=loss_labels(batch, "last_half")).loss.backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
    stats, memories = train_step(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), batch,
                                 [None] * chunks, lr=0.1, clip=0.0, precision="fp32", info=info,
                                 loss_positions="last_half")
    assert float(stats.loss) == pytest.approx(float(expected), rel=1e-6)  # device scalars until read
    assert int(stats.tokens) == B * (T - T // 2) and len(memories) == chunks
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        if r.grad is not None:
            torch.testing.assert_close(p.detach(), r.detach() - 0.1 * r.grad, rtol=1e-5, atol=1e-6)


def test_unknown_loss_positions_is_rejected():
    with pytest.raises(ValueError, match="loss_positions"):
        TrainConfig(loss_positions="first_half")
