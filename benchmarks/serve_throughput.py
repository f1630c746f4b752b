"""`txl serve`: aggregate tokens read per second with 1, 2, 4, 8, 16 sessions read concurrently.

A real `txl serve` process (a random small char model, memory 128, segments of 128) and N clients, each
reading Tiny Shakespeare into a session of its own, a segment per request (the first request 128
characters after the session's context token, the line break, so every later one ends on a segment boundary
and costs one forward); or, with
--mode generate, each generating 32 tokens per request. Requests of different
sessions that arrive together run as one batched forward (dynamic batching): the figure to read is the
aggregate tokens/s against N.

    python -m benchmarks.serve_throughput [--sessions 1 2 4 8 16] [--seconds 10] [--threads 1]

The server's torch threads default to one (``THREADS``): the clients run on the same machine, and a forward's
OpenMP threads that find their cores taken by the clients spin and wait for them (the collapse the benchmarks'
README describes); on a shared 2-core machine ``--threads 2`` ran 7x slower than ``--threads 1``. Give more on a
machine with cores to spare beyond the clients'.

``--baseline DIR`` also starts an older tree's server (DIR holds its ``txl`` copied as ``txl_old``: see
benchmarks/serve_step.py) and alternates the two at every measurement, so the machine's noise hits both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


async def measure(url: str, n: int, seconds: float, text: str, S: int, mode: str = "read") -> float:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=n + 2)) as c:
        ids = [(await c.post("/v1/sessions")).json()["id"] for _ in range(n)]
        # A first segment, untimed: S + 1 tokens with the session's context token (the line break) when it has one.
        first = S if (await c.get("/tokenizer_info")).json()["eos_token_id"] is not None else S + 1
        for k, sid in enumerate(ids):
            await c.post(f"/v1/sessions/{sid}/text", json={"text": text[k * 1000:k * 1000 + first]})
        counts = [0] * n
        deadline = time.monotonic() + seconds

        async def client(k: int) -> None:
            at = k * 1000 + first
            while time.monotonic() < deadline:
                if mode == "read":
                    r = await c.post(f"/v1/sessions/{ids[k]}/text", json={"text": text[at:at + S]})
                else:  # generation: one (B, 1) step per token, the sessions' steps batched together
                    r = await c.post(f"/v1/sessions/{ids[k]}/generate", json={"max_tokens": 32, "seed": at})
                r.raise_for_status()
                counts[k] += r.json()["tokens"]
                at += S

        t0 = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(n)))
        elapsed = time.monotonic() - t0
        for sid in ids:
            await c.delete(f"/v1/sessions/{sid}")
    return sum(counts) / elapsed


THREADS = 1
"""The server's torch threads unless --threads says otherwise: one leaves the second core of the smallest machine
to the clients (see the module's docstring)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--threads", type=int, default=THREADS,
                   help="the server's torch threads (default 1: the clients share the machine)")
    p.add_argument("--durability", default="shutdown", choices=["request", "shutdown"])
    p.add_argument("--rounds", type=int, default=2, help="passes over --sessions (interleaved; the best is kept)")
    p.add_argument("--mode", default="read", choices=["read", "generate"],
                   help="read: tokens read, a segment per request; generate: tokens generated, 32 per request")
    p.add_argument("--model", default=None)
    p.add_argument("--baseline", default=None, help="a directory holding an older tree's txl as txl_old")
    return p


def main() -> None:
    args = parser().parse_args()
    from benchmarks.serve_common import corpus_text, make_model_dir, start_server

    S = 128
    work = Path(tempfile.mkdtemp(prefix="txl-serve-throughput-"))
    model = Path(args.model) if args.model else make_model_dir(work / "model")
    trees = {"": "txl"}
    if args.baseline:
        sys.path.insert(0, args.baseline)
        trees = {"old ": "txl_old", "new ": "txl"}
    servers = {}
    try:
        for tree, package in trees.items():
            servers[tree] = start_server(model, work / f"serve{tree.strip()}.log", "--serve.state_dir",
                                         str(work / f"state{tree.strip()}"), "--serve.threads", str(args.threads),
                                         "--serve.durability", args.durability, "--serve.segment_len", str(S),
                                         "--serve.max_batch", "16", "--serve.max_sessions_in_memory", "64",
                                         package=package)
        text = corpus_text(1_000_000)
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for n in args.sessions:
                for tree, (_, url) in servers.items():
                    rate = asyncio.run(measure(url, n, args.seconds, text, S, args.mode))
                    rates.setdefault((tree, n), []).append(rate)
                    print(f"{tree}{n:>3} sessions: {rate:9.0f} tokens/s (load average {os.getloadavg()[0]:.1f})",
                          flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    summary = {}
    for tree in trees:
        best = {n: max(rates[(tree, n)]) for n in args.sessions}
        median = {n: statistics.median(rates[(tree, n)]) for n in args.sessions}
        one, one_median = best[min(best)], median[min(median)]
        for n in sorted(best):
            print(f"{tree}{n:>3} sessions: best of {args.rounds} {best[n]:9.0f} tokens/s ({best[n] / one:.2f}x one "
                  f"session), median {median[n]:9.0f} ({median[n] / one_median:.2f}x)")
        summary[tree.strip() or "tokens_per_s"] = {"best": best, "median": median}
    print(json.dumps({"mode": args.mode, **summary, "threads": args.threads, "durability": args.durability,
                      "load_average": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
