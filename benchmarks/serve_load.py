"""`txl serve` under load: clients mixing text, generation and completions over many sessions, with a RAM
budget small enough to force evictions; then every session is replayed serially and must end equal.

Each reply reports the session's request count, so the order in which the server applied one session's
requests is known; a fresh session given the same requests in that order, one at a time, must reach the same
totals (tokens read and generated, summed log-loss): nothing lost, nothing mixed. Prints requests/s, p50/p99
latency, errors, evictions, the server's peak RSS.

    python -m benchmarks.serve_load [--clients 32] [--seconds 60] [--sessions 100] [--in-memory 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path


async def run_load(url: str, *, clients: int, seconds: float, sessions: int, seed: int = 0, text: str = "",
                   max_tokens: int = 12) -> dict:
    """Drive the server at ``url``; returns figures and each session's request log (in applied order)."""
    import httpx

    text = text or "The cat sat on the mat. A dog ran to the red house.\n" * 50
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients + 4)) as c:
        ids = [(await c.post("/v1/sessions")).json()["id"] for _ in range(sessions)]
        logs: dict[str, list] = {sid: [] for sid in ids}
        for i, sid in enumerate(ids):  # some text first: a generation continues a text
            spec = {"text": text[i:i + 30]}
            r = await c.post(f"/v1/sessions/{sid}/text", json=spec)
            logs[sid].append((r.json()["session"]["requests"], "text", spec))
        latencies: list[float] = []
        errors: list[str] = []
        deadline = time.monotonic() + seconds

        async def client(k: int) -> None:
            rng = random.Random(seed * 1000 + k)
            while time.monotonic() < deadline:
                sid = rng.choice(ids)
                op = rng.choice(("text", "text", "generate", "completion"))
                start = rng.randrange(len(text) - 200)
                piece = text[start:start + rng.randint(1, 200)]
                n, s = rng.randint(1, max_tokens), rng.randrange(2**31)
                if op == "text":
                    spec = {"text": piece}
                    path = f"/v1/sessions/{sid}/text"
                elif op == "generate":
                    spec = {"max_tokens": n, "seed": s, "temperature": 0.8}
                    path = f"/v1/sessions/{sid}/generate"
                else:
                    spec = {"prompt": piece[:20], "max_tokens": n, "seed": s, "temperature": 0.8, "session": sid}
                    path = "/v1/completions"
                t = time.perf_counter()
                try:
                    r = await c.post(path, json=spec)
                except Exception as err:  # noqa: BLE001 - counted, the load goes on
                    errors.append(f"{type(err).__name__}: {err}")
                    continue
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                logs[sid].append((r.json()["session"]["requests"], path.rsplit("/", 1)[-1], spec))

        t0 = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(clients)))
        elapsed = time.monotonic() - t0
        finals = {sid: (await c.get(f"/v1/sessions/{sid}")).json() for sid in ids}
    latencies.sort()
    pick = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000) if latencies else \
        (lambda q: float("nan"))
    return {"requests": len(latencies), "seconds": elapsed, "rps": len(latencies) / elapsed, "p50_ms": pick(0.5),
            "p99_ms": pick(0.99), "errors": len(errors), "error_samples": errors[:5],
            "logs": {sid: sorted(log, key=lambda x: x[0]) for sid, log in logs.items()}, "finals": finals}


async def replay(url: str, logs: dict, finals: dict) -> list[str]:
    """Replay each session's requests serially in a fresh session; the sessions whose totals differ."""
    import httpx

    paths = {"text": "/v1/sessions/{}/text", "generate": "/v1/sessions/{}/generate", "completions": "/v1/completions"}
    bad = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        for sid, log in logs.items():
            new = (await c.post("/v1/sessions")).json()["id"]
            for _, kind, spec in log:
                spec = {**spec, "session": new} if kind == "completions" else spec
                r = await c.post(paths[kind].format(new), json=spec)
                assert r.status_code == 200, r.text
            got, want = (await c.get(f"/v1/sessions/{new}")).json(), finals[sid]
            same = all(got[k] == want[k] for k in ("tokens_read", "tokens_generated", "tokens_scored", "chars"))
            if not same or abs(got["nll"] - want["nll"]) > 1e-6 * max(1.0, abs(want["nll"])):
                bad.append(sid)
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--in-memory", type=int, default=20, help="serve.max_sessions_in_memory (forces evictions)")
    p.add_argument("--durability", default="request", choices=["request", "shutdown"])
    p.add_argument("--model", default=None, help="a model directory (default: a random small char model)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from benchmarks.serve_common import corpus_text, make_model_dir, peak_rss_mib, start_server

    work = Path(tempfile.mkdtemp(prefix="txl-serve-load-"))
    model = Path(args.model) if args.model else make_model_dir(work / "model")
    proc, url = start_server(model, work / "serve.log", "--serve.state_dir", str(work / "state"),
                             "--serve.max_sessions_in_memory", str(args.in_memory), "--serve.durability",
                             args.durability, "--serve.threads", str(args.threads), "--serve.max_queue", "1000")
    try:
        res = asyncio.run(run_load(url, clients=args.clients, seconds=args.seconds, sessions=args.sessions,
                                   text=corpus_text(100_000)))
        import httpx

        metrics = httpx.get(url + "/metrics").text
        evictions = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("txl_evictions_total"))
        rss = peak_rss_mib(proc.pid)
        bad = asyncio.run(replay(url, res["logs"], res["finals"]))
    finally:
        proc.terminate()
        proc.wait(60)
    out = {k: v for k, v in res.items() if k not in ("logs", "finals")}
    out.update(evictions=evictions, peak_rss_mib=rss, sessions=args.sessions, clients=args.clients,
               in_memory=args.in_memory, durability=args.durability, replay_mismatches=len(bad),
               exit_code=proc.returncode)
    print(f"{out['requests']} requests in {out['seconds']:.1f} s: {out['rps']:.1f} req/s, p50 {out['p50_ms']:.0f} ms, "
          f"p99 {out['p99_ms']:.0f} ms, errors {out['errors']}, evictions {evictions:.0f}, peak RSS "
          f"{rss:.0f} MiB, sessions differing from a serial replay: {len(bad)} of {args.sessions}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
