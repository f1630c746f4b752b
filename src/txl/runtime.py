"""Device and speed settings, applied at the boundary by the entry points (train, evaluate, generate, benchmarks).

Nothing here runs on import. ``retain_freed_memory()`` is a process setting the command-line tool and the
benchmarks call once; ``cpu_has_native_bf16`` tells whether bf16 autocast can pay on this CPU;
``resolve_precision`` turns ``precision="auto"`` into bf16 or fp32 for a device; ``matmul_precision`` allows
TF32 matmuls on CUDA for the duration of a run and restores the previous setting (the parity tests run with
it off, torch's default); ``compile_model`` is the one place ``torch.compile`` is applied; ``to_device`` moves
a host batch to the device through pinned memory without blocking the host. ``choose_threads`` picks the
CPU thread count of a command (``--threads``), and ``machine_record`` says which CPU kernels a run used (saved in
run.json: another CPU's kernels round differently, so the figures are reproducible per CPU kind).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the largest glibc accepts on 64-bit systems
_TRIM_THRESHOLD = 2**31 - 1


def retain_freed_memory() -> bool:
    """Keep freed tensor memory in the process for reuse instead of handing it back to the kernel.

    By default glibc serves large blocks with fresh ``mmap`` pages and gives freed ones back, so every
    step of a training loop faults its activations in again page by page (``benchmarks/changes.py``
    measured 9% of a base-shape training step on a 2-vCPU VM; at the small shape it is within noise). With blocks
    up to 32 MiB taken from the heap and the heap never trimmed, a loop that
    allocates the same shapes every step reuses the same pages; the resident size stays at the peak,
    which it reaches anyway. Returns False (and changes nothing) where the C library is not glibc.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512_BF16 or AMX); None if unknown.

    Without them torch runs bf16 matmuls through conversions or scalar loops: on an AVX2-only CPU a bf16
    ``torch.mm`` was measured at under 1 GFLOP/s against ~140 in fp32, so bf16 autocast is no speed-up.
    """
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        c = caps()
        return bool(c.get("avx512_bf16") or c.get("amx_bf16"))
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device: torch.device) -> str:
    """``precision`` as the run will use it: "auto" is bf16 on a CUDA device that supports it, else fp32.

    bf16 autocast needs no gradient scaler (its exponent range is fp32's) and on Ampere and later GPUs runs
    the matmuls on the bf16 tensor cores; on a CPU fp32 is the safe default (bf16 pays only with
    AVX512_BF16 or AMX, see ``cpu_has_native_bf16``), so "auto" never picks it there. The precision row of
    ``txl.model.plan.CHOICES`` (which this module sits below) says the same; tests/test_plan.py holds them equal.
    """
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


@contextlib.contextmanager
def matmul_precision(device: torch.device, *, tf32: bool) -> Iterator[None]:
    """Allow (or forbid) TF32 matmuls and convolutions on CUDA inside the block; restore the settings on exit.

    TF32 keeps fp32's range with a 10-bit mantissa in the products: on Ampere and later GPUs fp32 matmuls
    then run on tensor cores, several times faster, which training tolerates (NVIDIA's Transformer-XL
    recipe trains with it). It is set here, for one run, instead of at import, so nothing else in the
    process (the parity tests, a caller's own code) is changed behind its back. No effect on a CPU.
    """
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def compile_model(model: torch.nn.Module, enabled: bool = True) -> Callable[..., object]:
    """``torch.compile(model)`` when ``enabled``, else the model itself: what train, eval and generate call.

    The compiled wrapper shares the model's parameters (nothing is copied; checkpoints are written from
    the model, never from the wrapper). Shapes that change between calls (the first segment without
    memory, a shorter last segment, a generation memory that grows) recompile a few times before torch
    marks the dimension dynamic.
    """
    if not enabled:
        return model
    return torch.compile(model)


def to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A host tensor on ``device``; to CUDA through page-locked memory and without blocking the host.

    A copy from pinned memory is a DMA the GPU runs asynchronously, so the host goes on preparing the
    next batch while it runs; a later kernel on the same stream waits for it, so no explicit sync is needed.
    None or a CPU device returns the tensor unchanged.
    """
    if device is None:
        return tensor
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


__all__ = ["compile_model", "cpu_has_native_bf16", "matmul_precision", "resolve_precision", "retain_freed_memory",
           "to_device"]


def busy_cpus(interval: float = 0.2) -> float | None:
    """How many CPUs other processes kept busy over ``interval`` seconds (Linux /proc/stat), None if unknown."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # all time, idle + iowait (guest time is inside user)

    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (os.cpu_count() or 1) * (1.0 - (idle1 - idle0) / (total1 - total0))


def choose_threads(requested: int | None) -> tuple[int, str]:
    """The CPU thread count of a command, and why: ``requested`` (``--threads N``), else OMP_NUM_THREADS
    (torchrun sets 1 per process), else 1.

    Why one thread by default, not torch's default (every core):
    - its OpenMP threads wait for each other at every parallel region, so when another process holds one of
      two cores a step takes ~20x longer (issue 28: the default job ran 28 steps in 60 s with 2 threads against
      548 with 1 beside one busy process; on the shared machine of this change, 0-9 steps against 20-70);
    - the thread count changes the figures: torch splits reductions by thread, so the gradients of 1 and 2
      threads differ in the last bits (2e-9 on the default job's model) and a 2,000-step run ends elsewhere;
      one thread gives the same figures on every machine of a CPU kind, whatever its cores and load.
    """
    if requested is not None:
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    return 1, "the default: the same figures on every machine of a CPU kind, and no waiting on a busy core"


def oversubscribed(threads: int) -> str | None:
    """Advice when ``threads`` exceed the cores idle right now (their threads would wait on the busy ones), or
    None: the collapse torch's thread pool suffers on a shared machine, detected before the run starts."""
    if threads <= 1:
        return None
    busy = busy_cpus()
    if busy is None:
        return None
    idle = max(0.0, (os.cpu_count() or threads) - busy)
    if threads <= idle + 0.5:
        return None
    return (f"{threads} CPU threads but only {idle:.1f} cores are idle ({busy:.1f} busy with other work): each "
            "parallel step waits for the thread on a busy core, up to ~20x slower; use --threads "
            f"{max(1, int(idle + 0.5))}")


def machine_record() -> dict[str, object]:
    """Where a run ran, for run.json: the CPU kernels torch dispatches to (ATEN_CPU_CAPABILITY can lower them:
    ``avx2`` reproduces an AVX2 machine's figures on an AVX-512 one), the thread count, torch and Python."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "cpu": platform.machine()}
