"""txl.model.plan: every device-dependent choice in one table, resolved for a named device type on any device."""

import dataclasses
import typing

import pytest
import torch
from conftest import tiny_config

from txl.config import KERNEL_FIELDS, ModelConfig, TrainConfig
from txl.model import TransformerXL, plan
from txl.model.adaptive import pad_multiple, rows_mode
from txl.model.dropout import FastDropout
from txl.model.transformer import residual_mode

EXPECTED = {  # device type -> what the defaults resolve to; written out, so a change to the table is seen here
    "cpu": dict(residual_dtype="params", cluster_rows="selected", softmax_pad=1, dropout_impl="fast"),
    "cuda": dict(residual_dtype="compute", cluster_rows="all", softmax_pad=64, dropout_impl="torch"),
    "mps": dict(residual_dtype="params", cluster_rows="all", softmax_pad=1, dropout_impl="torch"),
    "xpu": dict(residual_dtype="params", cluster_rows="all", softmax_pad=1, dropout_impl="torch"),
}


@pytest.mark.parametrize("device_type", plan.DEVICE_TYPES)
def test_resolve_replaces_every_device_dependent_default(device_type):
    config = tiny_config()
    resolved = plan.resolve(config, device_type)
    assert {name: getattr(resolved, name) for name in EXPECTED[device_type]} == EXPECTED[device_type]
    assert resolved.cast_weights == "auto"  # decided by the wrapper (DDP, FSDP), not by the device
    # Only the how moved: every other field as it was, and a resolved config no longer depends on the device (but
    # the CPU's 'fast' dropout: its gap sampler has no name of its own, and 'fast' is torch's kernel elsewhere).
    moved = {f.name for f in dataclasses.fields(ModelConfig) if getattr(config, f.name) != getattr(resolved, f.name)}
    assert moved <= set(KERNEL_FIELDS)
    assert plan.resolve(resolved, device_type) == resolved
    for other in plan.DEVICE_TYPES:
        again = plan.resolve(resolved, other)
        assert again == (resolved if device_type != "cpu" else resolved.replace(
            dropout_impl=EXPECTED[other]["dropout_impl"]))
    assert config.residual_dtype == "auto"  # a copy: the input is not changed


@pytest.mark.parametrize("device_type", plan.DEVICE_TYPES)
def test_the_forward_reads_the_same_table(device_type):
    """The functions the forward calls with its tensors' device agree with ``resolve`` for that device type."""
    device = torch.device(device_type)
    config = plan.resolve(tiny_config(), device_type)
    assert residual_mode("auto", device) == config.residual_dtype
    assert rows_mode("auto", device) == config.cluster_rows
    assert pad_multiple(0, device) == config.softmax_pad
    meta = torch.empty(3, device="meta")  # the dropout module asks its input's device type
    on_device = FastDropout(0.1).torch_kernel(torch.empty(3)) if device_type == "cpu" else FastDropout(
        0.1).torch_kernel(meta)
    assert on_device == (config.dropout_impl == "torch")
    assert plan.resolve_precision("auto", device_type) == ("bf16" if device_type == "cuda" else "fp32")
    assert plan.resolve_precision("fp16", device_type) == "fp16"
    assert plan.fsdp_mixed_precision("bf16", device_type) == (device_type == "cuda")
    assert not plan.fsdp_mixed_precision("fp32", device_type)


def test_every_auto_of_the_config_is_in_the_table_or_named_as_not_the_devices():
    """A new 'auto' field must say what each device makes of it (or be listed here as decided elsewhere)."""
    decided_elsewhere = {"cast_weights"}  # the wrapper's choice (plan's docstring)
    autos = {f.name for f in dataclasses.fields(ModelConfig)
             if "auto" in typing.get_args(typing.get_type_hints(ModelConfig)[f.name])}
    table = {c.field for c in plan.CHOICES}
    assert autos - decided_elsewhere <= table, autos - table
    assert "softmax_pad" in table  # its 'auto' is 0
    for choice in plan.CHOICES:  # each resolution is a valid value of its field
        for value in (choice.cpu, choice.cuda, choice.other):
            if choice.field in ("precision", "graphs"):  # TrainConfig's
                TrainConfig(**{choice.field: value})
            elif choice.field in autos | {"softmax_pad", "dropout_impl"}:
                tiny_config(**{choice.field: value})


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
        plan.resolve(tiny_config(), "gpu")


def test_a_model_resolved_for_cuda_runs_cudas_path_on_the_cpu():
    """Built from ``resolve(config, 'cuda')`` on the CPU, under bf16 autocast the residual stream is 16-bit (CUDA's
    'auto'), where the CPU's own resolution keeps it float32."""
    config = tiny_config(cutoffs=[20, 40])  # div_val 1: the embedding hands the first layer float32
    ids = torch.randint(0, 61, (2, 5))
    for device_type, stream in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        torch.manual_seed(0)
        model = TransformerXL(plan.resolve(config, device_type)).eval()
        seen: list[torch.dtype] = []
        hook = model.layers[0].register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].dtype))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids)
        hook.remove()
        assert seen == [stream], device_type
