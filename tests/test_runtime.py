"""Process settings (txl.runtime) and the optimiser choice."""

import platform
from pathlib import Path

import pytest
import torch

from txl.config import OptimConfig
from txl.optim import build_optimizer
from txl.runtime import cpu_has_native_bf16, retain_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_retain_freed_memory_is_accepted_by_glibc():
    assert retain_freed_memory() is True
    assert retain_freed_memory() is True  # idempotent


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="needs /proc/cpuinfo")
def test_native_bf16_matches_the_cpu_flags():
    flags = Path("/proc/cpuinfo").read_text(errors="replace")
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_fused_adam_where_torch_has_it_else_the_plain_one(monkeypatch):
    model = torch.nn.Linear(4, 3)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    assert optimizer.defaults["fused"] is True
    original = torch.optim.Adam

    def no_fused(params, fused=None, **kw):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return original(params, **kw)

    monkeypatch.setattr(torch.optim, "Adam", no_fused)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    assert not optimizer.defaults["fused"]
    assert len(optimizer.param_groups[0]["params"]) == 2
