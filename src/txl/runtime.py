"""Process-wide settings that make CPU training and evaluation faster, applied by the entry points.

Nothing here runs on import: the command-line tool, the benchmarks and the experiments call
``retain_freed_memory()`` once at start-up, and a library user may call it too. ``cpu_has_native_bf16``
tells whether bf16 autocast can be a speed-up on this CPU at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
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


__all__ = ["cpu_has_native_bf16", "retain_freed_memory"]
