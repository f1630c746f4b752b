"""txl.model.plan: every device-dependent choice in one table, resolved for a named device type on any device."""

import dataclasses
import typing

import pytest
import torch
from conftest import tiny_config

from txl.config import ComputeConfig, TrainConfig
from txl.model import TransformerXL, plan
from txl.model.dropout import Dropout

EXPECTED = {  # device type -> what the defaults resolve to; written out, so a change to the table is seen here
    "cpu": dict(cluster_rows="selected", softmax_pad=1, dropout_impl="fast"),
    "cuda": dict(cluster_rows="capacity", softmax_pad=64, dropout_impl="torch"),
    "mps": dict(cluster_rows="capacity", softmax_pad=1, dropout_impl="torch"),
    "xpu": dict(cluster_rows="capacity", softmax_pad=1, dropout_impl="torch"),
}


@pytest.mark.parametrize("device_type", plan.DEVICE_TYPES)
def test_resolve_replaces_every_device_dependent_default(device_type):
    config = ComputeConfig()
    resolved = plan.resolve(config, device_type)
    assert {name: getattr(resolved, name) for name in EXPECTED[device_type]} == EXPECTED[device_type]
    assert resolved.cast_weights == "auto"  # decided by the wrapper (DDP, FSDP), not by the device
    # A resolved config no longer depends on the device (but the CPU's 'fast' dropout: its gap sampler has no name
    # of its own, and 'fast' is torch's kernel elsewhere).
    assert (resolved.attn_impl, resolved.recompute_attention) == ("fused", False)
    assert plan.resolve(resolved, device_type) == resolved
    for other in plan.DEVICE_TYPES:
        again = plan.resolve(resolved, other)
        assert again == (resolved if device_type != "cpu" else resolved.replace(
            dropout_impl=EXPECTED[other]["dropout_impl"]))
    assert config.cluster_rows == "auto"  # a copy: the input is not changed


@pytest.mark.parametrize("device_type", plan.DEVICE_TYPES)
def test_the_compute_plan_reads_the_same_table(device_type):
    """What a model's forward reads (``compute_plan``, made once for its device) agrees with ``resolve`` for that
    device type."""
    config = ComputeConfig(attn_impl="reference", recompute_attention=True, cast_weights="per_use")
    resolved = plan.resolve(config, device_type)
    compute = plan.compute_plan(config, device_type)
    assert (compute.cluster_rows, compute.softmax_pad) == (resolved.cluster_rows, resolved.softmax_pad)
    assert (compute.attn_impl, compute.recompute_attention, compute.cast_weights) == ("reference", True, "per_use")
    assert compute.gap_dropout == (resolved.dropout_impl == "fast")
    assert compute.pin_sdpa == (device_type != "cpu")
    assert plan.resolve_precision("auto", device_type) == ("bf16" if device_type == "cuda" else "fp32")
    assert plan.resolve_precision("fp16", device_type) == "fp16"
    assert plan.fsdp_mixed_precision("bf16", device_type) == (device_type == "cuda")
    assert not plan.fsdp_mixed_precision("fp32", device_type)


def test_a_model_plans_where_it_is_built_and_again_where_it_moves():
    """The plan is made for the parameters' device and handed to the modules that read it; a move makes it again
    (here to 'meta', which resolves as the table's 'other'); no forward asks the device."""
    compute = ComputeConfig(recompute_attention=True, cast_weights="per_use")
    model = TransformerXL(tiny_config(cutoffs=[20, 40], dropout=0.1), compute)
    assert model.plan == plan.compute_plan(compute, "cpu")
    assert model.softmax.rows == model.embed.rows == "selected" and model.softmax.pad == 1
    assert model.softmax.cast_weights == "per_use" and all(layer.attn.recompute for layer in model.layers)
    assert all(m.gaps for m in model.modules() if isinstance(m, Dropout))
    assert not any(layer.attn.pin_sdpa for layer in model.layers)
    model.to("meta")
    assert model.plan.device_type == "meta" and model.softmax.rows == "capacity" and not model.drop.gaps
    assert all(layer.attn.pin_sdpa for layer in model.layers)
    assert model.config == tiny_config(cutoffs=[20, 40], dropout=0.1)  # what the model is: unchanged
    assert model.compute == compute


def test_every_auto_of_the_config_is_in_the_table_or_named_as_not_the_devices():
    """A new 'auto' field must say what each device makes of it (or be listed here as decided elsewhere)."""
    decided_elsewhere = {"cast_weights"}  # the wrapper's choice (plan's docstring)
    autos = {f.name for f in dataclasses.fields(ComputeConfig)
             if "auto" in typing.get_args(typing.get_type_hints(ComputeConfig)[f.name])}
    table = {c.field for c in plan.CHOICES}
    assert autos - decided_elsewhere <= table, autos - table
    assert "softmax_pad" in table  # its 'auto' is 0
    for choice in plan.CHOICES:  # each resolution is a valid value of its field
        for value in (choice.cpu, choice.cuda, choice.other):
            if choice.field in ("precision", "graphs"):  # TrainConfig's
                TrainConfig(**{choice.field: value})
            elif choice.field in autos | {"softmax_pad", "dropout_impl"}:
                ComputeConfig(**{choice.field: value})


def test_the_runs_precision_is_the_tables(monkeypatch):
    """txl.runtime.resolve_precision (below txl.model, so it cannot read the table) resolves 'auto' as the table
    does on every device type, on a GPU that supports bf16."""
    from txl.runtime import resolve_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for device_type in plan.DEVICE_TYPES:
        for precision in ("auto", "fp32", "bf16", "fp16"):
            assert resolve_precision(precision, torch.device(device_type)) == plan.resolve_precision(
                precision, device_type), (device_type, precision)


def test_an_unknown_device_type_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="'gpu' is unknown; choose one of cpu, cuda, mps, xpu"):
        plan.resolve(ComputeConfig(), "gpu")


def test_a_checkpoint_computes_the_same_under_the_cpu_and_the_cuda_plan():
    """Built with ``resolve(compute, 'cuda')`` on the CPU the model runs CUDA's path (the tails' static 'capacity' rows,
    softmax widths padded to 64, torch's dropout kernel); the CPU plan's checkpoint loads into it and gives the same
    loss, log-probabilities and gradients up to rounding."""
    config = tiny_config(cutoffs=[20, 40])
    ids = torch.randint(0, 61, (2, 6))
    torch.manual_seed(0)
    cpu = TransformerXL(config)
    cuda = TransformerXL(config, plan.resolve(ComputeConfig(), "cuda"))
    cuda.load_state_dict(cpu.state_dict())
    assert (cuda.softmax.rows, cuda.softmax.pad, cpu.softmax.rows, cpu.softmax.pad) == ("capacity", 64, "selected", 1)
    outs = []
    for model in (cpu, cuda):
        out = model(ids[:, :-1], labels=ids[:, 1:], return_log_probs=True)
        out.loss.backward()
        outs.append((out.log_probs, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_resolve_refuses_a_model_config():
    """A ModelConfig has none of the how-fields: resolved, it would come back as it is and the model would run its
    own device's path, silently. Refused, naming the call to make."""
    with pytest.raises(TypeError, match=r"plan.resolve takes a ComputeConfig, not a ModelConfig"):
        plan.resolve(tiny_config(), "cuda")
