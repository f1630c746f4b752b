"""Scaling on CPU: tokens/s of 1 against 2 processes (DDP and FSDP2), and the measured peak beside `txl size`.

    python -m benchmarks.scaling                     # small shape, 1 and 2 processes, DDP and FSDP (~3 min here)
    python -m benchmarks.scaling --steps 20 --repeats 3

Each configuration is one ``torchrun --standalone`` job of W processes (W = 1 runs without a process group)
stepping the trainer's own ``txl.train.train_step`` on random byte-level tokens with a fixed global batch, so
2 processes do the same work as 1, each on half the streams: tokens/s counts the global batch. Every process
uses ``--threads`` threads (1: two processes fill the two cores a single one leaves half idle, the honest
comparison on this machine is ``--threads 1`` for both). After the timed steps, one more step runs under
torch's MemTracker (torch.distributed._tools.mem_tracker: every tensor's bytes, by dispatch), whose peak is
printed beside ``txl.sizing.estimate``'s prediction for the same shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

SHAPE = {"n_layer": 4, "d_model": 256, "n_head": 4, "d_head": 64, "d_inner": 1024, "mem_len": 64, "vocab_size": 204,
         "dropout": 0.0}
"""The benchmark's small shape (benchmarks.run's 'small' with a shorter memory: tgt_len = mem_len = 64)."""


def run_config(parallel: str, checkpointing: bool, batch: int, tgt_len: int):
    from txl.config import RunConfig
    from txl.presets import run_config as preset

    data = preset("tiny").to_dict()
    data["model"].update(SHAPE)
    data["train"].update(batch_size=batch, tgt_len=tgt_len, parallel=parallel, activation_checkpointing=checkpointing,
                         device="cpu")
    return RunConfig.from_dict(data)


def worker(args: argparse.Namespace) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from txl import parallel
    from txl.data import Batch
    from txl.distributed import all_reduce_sum, init_distributed, shutdown
    from txl.model import TransformerXL
    from txl.optim import build_optimizer
    from txl.train import train_step

    torch.set_num_threads(args.threads)
    info = init_distributed("cpu")
    cfg = run_config(args.parallel, args.checkpointing, args.batch, args.tgt_len)
    torch.manual_seed(0)
    model = TransformerXL(cfg.model)
    wrapped = parallel.wrap(model, info, parallel=args.parallel, activation_checkpointing=args.checkpointing,
                            precision="fp32")
    optimizer = build_optimizer(model, cfg.optim)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    local = args.batch // info.world_size
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.tgt_len + 1), generator=gen)
    rows = tokens[info.rank * local:(info.rank + 1) * local]
    batch = Batch(input_ids=rows[:, :-1].contiguous(), labels=rows[:, 1:].contiguous(), context_len=0, start=1)
    memories: list = [None]
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        _, memories = train_step(wrapped, optimizer, scaler, batch, memories, lr=1e-4, clip=0.25, precision="fp32",
                                 info=info)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _, memories = train_step(wrapped, optimizer, scaler, batch, memories, lr=1e-4, clip=0.25, precision="fp32",
                                 info=info)
    peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    step_s = statistics.median(times)
    peak_max = max(all_reduce_sum([0.0] * info.rank + [float(peak)] + [0.0] * (info.world_size - info.rank - 1),
                                  info))
    if info.is_main:
        print(json.dumps({"parallel": args.parallel, "world_size": info.world_size, "checkpointing": args.checkpointing,
                          "step_s": step_s, "tokens_per_s": args.batch * args.tgt_len / step_s,
                          "peak_bytes": int(peak_max), "threads": args.threads}), flush=True)
    shutdown(info)


def launch(args: argparse.Namespace, parallel: str, world: int, checkpointing: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.scaling", "--worker", "--parallel", parallel, "--batch", str(args.batch),
           "--tgt-len", str(args.tgt_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)] + (["--checkpointing"] if checkpointing else [])
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               "-m", "benchmarks.scaling", *cmd[3:]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        out, failed = proc.stdout, proc.returncode and proc.stderr[-3000:]
    except subprocess.TimeoutExpired as err:  # a worker that printed its figures but did not exit still counts
        out, failed = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), "timeout"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{' '.join(cmd)}: {failed}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=8, help="global batch (streams), the same at every process count")
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads per process")
    p.add_argument("--repeats", type=int, default=1, help="run the whole grid this many times (interleaved)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from txl.sizing import estimate, human

    grid = [(par, w, ck) for par in ("ddp", "fsdp") for w in (1, 2) for ck in (False, True)]
    results: dict = {}
    for _ in range(args.repeats):
        for key in grid:
            results.setdefault(key, []).append(launch(args, *key))
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"# global batch {args.batch} x tgt_len {args.tgt_len}, shape {SHAPE}; {args.threads} thread(s) per "
          f"process; load average {load} at the end")
    print("| parallel | processes | act. ckpt | tokens/s | vs 1 process | peak measured | peak predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for par, w, ck in grid:
        runs = results[(par, w, ck)]
        tok = statistics.median(r["tokens_per_s"] for r in runs)
        one = statistics.median(r["tokens_per_s"] for r in results[(par, 1, ck)])
        measured = statistics.median(r["peak_bytes"] for r in runs)
        predicted = estimate(run_config(par, ck, args.batch, args.tgt_len), world_size=w, parallel=par,
                             checkpointing=ck).peak
        print(f"| {par} | {w} | {'on' if ck else 'off'} | {tok:,.0f} | {tok / one:.2f}x | {human(measured)} | "
              f"{human(predicted)} | {(predicted - measured) / measured:+.1%} |")
        print(json.dumps({"parallel": par, "world_size": w, "checkpointing": ck, "tokens_per_s": tok,
                          "peak_measured": measured, "peak_predicted": predicted}), file=sys.stderr)
    for w in (1, 2):
        for ck in (False, True):
            d = statistics.median(r["tokens_per_s"] for r in results[("ddp", w, ck)])
            f = statistics.median(r["tokens_per_s"] for r in results[("fsdp", w, ck)])
            print(f"sharding overhead at {w} process(es), act. ckpt {'on' if ck else 'off'}: FSDP {f:,.0f} tok/s "
                  f"against DDP {d:,.0f} ({f / d - 1:+.1%})")


if __name__ == "__main__":
    main()
