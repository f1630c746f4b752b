"""`txl serve`'s engine without HTTP: a batched read step and a batched generation, per batch size.

Runs the engine's ``Model`` directly (no server, no sampling): B sessions with memories of mem_len rows
read one segment each as one forward ('read'), or prefill their last segment and take ``--steps`` (B, 1)
generation steps on the kept batch ('generate'); batch sizes are interleaved, repeated, and the median
tokens/s of each printed with its ratio to B = 1. ``--profile`` prints torch.profiler's top operators
for one read and one generation at the largest B.

    OMP_NUM_THREADS=1 python -m benchmarks.serve_step [--batch 1 8] [--repeats 5] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.serve_common import make_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--segment-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import txl
    from txl.serve.engine import Model, Unit

    with tempfile.TemporaryDirectory() as tmp:
        model = txl.from_pretrained(make_model_dir(Path(tmp) / "model"))
    S = args.segment_len
    m = Model(model, segment_len=S, mem_len=model.config.mem_len, same_length=False, clamp_len=0)
    L, d, V = model.config.n_layer, model.config.d_model, model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def read(B: int) -> int:
        units = [Unit("score", torch.randint(0, V, (S,), generator=g).tolist(), torch.randn(L, m.mem_len, d),
                      torch.randint(0, V, (S,), generator=g).tolist()) for _ in range(B)]
        m.run("score", units)
        return B * S

    def generate(B: int) -> int:
        # Prefill alone per session (their lengths differ in the server), then the steps batched.
        rows = [m.run("prefill", [Unit("prefill", torch.randint(0, V, (S,), generator=g).tolist(),
                                       torch.randn(L, m.mem_len, d))])[0] for _ in range(B)]
        start = time.perf_counter()
        for _ in range(args.steps):
            rows = m.run("step", [Unit("step", [1], row=r.row) for r in rows])
        return B * args.steps, time.perf_counter() - start

    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for B in args.batch:
            start = time.perf_counter()
            n = read(B)
            times.setdefault(("read", B), []).append(n / (time.perf_counter() - start))
            n, seconds = generate(B)
            times.setdefault(("generate steps", B), []).append(n / seconds)
    for what in ("read", "generate steps"):
        one = statistics.median(times[(what, args.batch[0])])
        for B in args.batch:
            rate = statistics.median(times[(what, B)])
            print(f"{what:>15} B={B:>2}: {rate:9.0f} tokens/s ({rate / one:.2f}x B={args.batch[0]})")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        B = max(args.batch)
        for what, fn in (("read", read), ("generate", generate)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn(B)
            print(f"-- {what}, B={B}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
