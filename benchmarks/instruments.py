"""The benchmark's measuring instruments: clocks, this machine's matmul peak, the profiler, memory, the CPU's name.

MFU divides each step's achieved FLOP/s (``benchmarks.flops``) by the mean of two peak samples around it
(``Bracket``), so that on a shared, noisy machine the step and its peak are measured under the same conditions.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

PEAK_N = {"cpu": 2048, "cuda": 8192}
"""The side of the n-cubed matmul that measures the peak, per device type."""
CPU = torch.device("cpu")


class Profile:
    """torch.profiler around one step; ``table`` is its top operators by self time (device time on a GPU);
    ``host_ms`` and ``device_ms`` its host (CPU) and device (CUDA) time in all."""

    def __init__(self, device: torch.device, rows: int = 18) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof, self.rows, self.device, self.table = profile(activities=activities), rows, device, ""
        self.host_ms = self.device_ms = 0.0

    def __enter__(self) -> Profile:
        self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(*exc)
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        averages = self.prof.key_averages()
        self.table = averages.table(sort_by=key, row_limit=self.rows, max_name_column_width=48)
        # The step's host time (every op's own CPU time: what the host spends issuing it) and device time (every
        # kernel's, once): a step whose host time exceeds its device time leaves the GPU waiting on the host.
        self.host_ms = sum(e.self_cpu_time_total for e in averages) / 1e3
        self.device_ms = device_time_us(averages) / 1e3 if self.device.type == "cuda" else 0.0


def device_time_us(averages) -> float:
    """The device time of a profile's events, each kernel counted once, as the profiler's own "Self CUDA time total"
    counts it: the device's events (kernels, copies), not the host ops that launched them (whose self device time is
    the same kernels again: aten::copy_ beside its Memcpy) nor the annotations spanning them (a compiled graph's
    "## Call CompiledFxGraph" range)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in averages
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))



def make_clock(device: torch.device):
    """perf_counter, after waiting for the device's queued kernels on a GPU (they run asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


class MatmulPeak:
    """This machine's matmul FLOP/s: an n-cubed mm in one dtype on one device, timed on demand.

    The phases sample it around every timed step (``Bracket``), so each step's FLOP/s is divided by a peak
    measured on the same (shared, noisy) machine moments before and after; the operands stay allocated
    (``nbytes``; a GPU phase subtracts them from its peak memory). On a GPU one sample is ``reps`` mms
    (a single 8192-cubed one takes about a millisecond, close to the launch and sync overhead). TF32 is
    whatever ``matmul_precision`` allows around the caller.
    """

    def __init__(self, dtype: torch.dtype, clock=time.perf_counter, n: int | None = None,
                 device: torch.device = CPU) -> None:
        self.clock, self.n = clock, n or PEAK_N[device.type]
        self.reps = 1 if device.type == "cpu" else 10
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(self.n, self.n, generator=g).to(device=device, dtype=dtype)
        self.b = torch.randn(self.n, self.n, generator=g).to(device=device, dtype=dtype)
        self.c = torch.mm(self.a, self.b)  # also the warm-up
        self.nbytes = 3 * self.a.numel() * self.a.element_size()

    def sample(self) -> float:
        t0 = self.clock()
        for _ in range(self.reps):
            torch.mm(self.a, self.b, out=self.c)
        return 2 * self.n**3 * self.reps / (self.clock() - t0)


class Bracket:
    """Peak samples around the timed steps: one before the first, one after each; a step gets their mean."""

    def __init__(self, peak: MatmulPeak) -> None:
        self.peak, self.last = peak, None

    def around(self) -> float:
        """Call right after a timed step: the mean of the samples before and after it."""
        after = self.peak.sample()
        before, self.last = self.last, after
        return (before + after) / 2

    def start(self) -> None:
        """Call right before the first timed step."""
        self.last = self.peak.sample()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 and AMX (what bf16 and fp32 speed depend on), and the
    kernels torch runs on it (``ATEN_CPU_CAPABILITY=avx2`` picks the AVX2 ones on an AVX-512 CPU)."""
    kernels = f"torch kernels {torch.backends.cpu.get_cpu_capability()}"
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return f"unknown CPU; {kernels}"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "CPU")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    has = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(has) or 'no AVX2'}; {'no ' if 'avx512f' not in flags else ''}AVX-512, " \
           f"{'no ' if 'amx_bf16' not in flags else ''}AMX; {kernels})"
