"""FlexAttention (``flex_attention`` here) beside the fused SDPA path, one relative-attention layer, forward and
backward.

    python -m benchmarks.flex --device cuda            # NVIDIA's shape: training T 192, M 192; evaluation T 64, M 640
    python -m benchmarks.flex --smoke                  # a CPU, tiny sizes, forward only (no FlexAttention backward)

The same operands go to both: a scaled query with u, keys and values of [memory; segment], (q + v) and W_kR R.
SDPA's side is ``kernels.fused_attention`` as the model calls it (evaluation: the realigned bias and mask as
SDPA's dense additive mask; training: ``_RecomputedAttention``, which recomputes the scores in backward);
FlexAttention's is ``relative_flex_attention`` through ``torch.compile(flex_attention)`` (the positional scores
by distance, read by a score_mod; a causal block mask). On a CPU FlexAttention runs unfused (eager, torch's
reference loop): the smoke checks the machinery and the numbers, not the speed. Each side is warmed up (its
compilation included), then timed over --reps repetitions; medians and their spread. Prints a table and one
JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings

import torch

from benchmarks.flex_attention import relative_bias, relative_flex_attention
from benchmarks.instruments import make_clock
from txl.model import kernels
from txl.model.positions import attention_mask

# (name, B, T, M): NVIDIA's WikiText-103 base per GPU (benchmarks.flops SHAPES['nvidia']), 8 heads of 64.
CUDA_CASES = [("train", 32, 192, 192), ("eval", 32, 64, 640)]
SMOKE_CASES = [("train", 2, 8, 8), ("eval", 2, 4, 12)]


def operands(B: int, T: int, M: int, H: int, D: int, device: torch.device, dtype: torch.dtype, grad: bool):
    g = torch.Generator().manual_seed(0)
    K = M + T
    shapes = [(B, T, H, D), (B, K, H, D), (B, K, H, D), (H, B * T, D), (K, H, D)]
    return [(torch.randn(s, generator=g) * 0.5).to(device, dtype).requires_grad_(grad) for s in shapes]


def timed(fn, clock, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def measure(device: torch.device, dtype: torch.dtype, cases, H: int, D: int, warmup: int, reps: int,
            backward: bool) -> list[dict]:
    from torch.nn.attention.flex_attention import flex_attention

    clock = make_clock(device)
    attend = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else None
    rows = []
    for name, B, T, M in cases:
        grad = backward and name == "train"
        inputs = operands(B, T, M, H, D, device, dtype, grad)
        mask = attention_mask(T, M, mem_len=M, same_length=False, style="pytorch", device=device)

        def sdpa(inputs=inputs, mask=mask, grad=grad):
            query, k, val, qv, r = inputs
            with torch.set_grad_enabled(grad):
                out = kernels.fused_attention(query, k, val, mask=mask, bias_fn=relative_bias,
                                              bias_inputs=(qv, r))
                if grad:
                    out.sum().backward()
            return out

        def flex(inputs=inputs, grad=grad):
            with torch.set_grad_enabled(grad):
                out = relative_flex_attention(*inputs, attend=attend)
                if grad:
                    out.sum().backward()
            return out

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention (a CPU) says it runs unfused
            diff = (sdpa().float() - flex().float()).abs().max().item()
            t_sdpa = timed(sdpa, clock, warmup, reps)
            t_flex = timed(flex, clock, warmup, reps)
        med = {"sdpa": statistics.median(t_sdpa), "flex": statistics.median(t_flex)}
        rows.append(dict(case=name, batch=B, tgt_len=T, mem_len=M, heads=H, d_head=D, dtype=str(dtype),
                         device=str(device), backward=grad, sdpa_ms=1e3 * med["sdpa"], flex_ms=1e3 * med["flex"],
                         flex_over_sdpa=med["sdpa"] / med["flex"], max_abs_diff=diff, reps=reps,
                         spread={k: (max(v) - min(v)) / statistics.median(v)
                                 for k, v in (("sdpa", t_sdpa), ("flex", t_flex))}))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.flex", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cuda:N; cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="a CPU, tiny sizes, forward only")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (compilation included)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available on this machine; --smoke runs on a CPU")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases, (H, D) = (SMOKE_CASES, (2, 8)) if args.smoke else (CUDA_CASES, (8, 64))
    rows = measure(device, dtype, cases, H, D, args.warmup, args.reps, backward=device.type == "cuda")
    print(f"{'case':<6} {'B':>3} {'T':>4} {'M':>4} {'bwd':>4} {'SDPA ms':>8} {'flex ms':>8} {'flex speed':>10} "
          f"{'max |diff|':>10}")
    for r in rows:
        bwd = "yes" if r["backward"] else "no"
        print(f"{r['case']:<6} {r['batch']:>3} {r['tgt_len']:>4} {r['mem_len']:>4} {bwd:>4} "
              f"{r['sdpa_ms']:>8.3f} {r['flex_ms']:>8.3f} {r['flex_over_sdpa']:>9.2f}x {r['max_abs_diff']:>10.2e}")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
