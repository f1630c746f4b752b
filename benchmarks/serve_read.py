"""`txl serve` reading: how much batching can gain, and where one read request's time goes.

1. The forward alone (the engine's ``Model.run`` of B sessions' 128-token segments with memories of 128): its
   executed FLOPs against this machine's matmul peak (``benchmarks.instruments.MatmulPeak``, sampled before and
   after every timed forward), per batch size B, interleaved and repeated. Both are timed in this thread's CPU
   time (one torch thread), so other processes on the shared cores cannot make a long peak sample look slower
   than a short forward (wall-clock tokens/s are printed beside). Executed FLOPs per forward (the
   evaluation FLOP model of ``benchmarks.flops`` plus what the server computes again per request, its state
   being the memory alone): 2 (N + S) T B + 6 L H D K T B (projections, output layer and attention of the
   segment) + 4 L d H D M B (the memory rows' keys and values) + 2 L d H D K (W_kR R, shared by the batch).
   The batching gain cannot exceed peak / (FLOP/s at B = 1); the FF matmul of the forward's shape run alone at
   B = 1 and at the largest B shows how close to the peak a matmul of that shape gets.
2. One read request through HTTP: a `txl serve` process (durability 'request': each changed state written and
   fsynced before the reply) and one client reading a segment per request, then ``--clients`` clients; from
   the server's own metrics (txl_forward_seconds, txl_state_write_seconds, txl_request_seconds) and the client's
   clock: the forward, the state write, tokenising (timed here on the same text), the rest (HTTP, JSON,
   queueing) per request.

    OMP_NUM_THREADS=1 python -m benchmarks.serve_read [--batch 1 2 4 8 16] [--repeats 7] [--requests 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.flops import Shape, flops_per_token
from benchmarks.instruments import Bracket, MatmulPeak, cpu_model
from benchmarks.serve_common import corpus_text, make_model_dir, start_server


def forward_flops(c, B: int, T: int, M: int) -> float:
    """Executed FLOPs of one batched read forward (the module docstring)."""
    shape = Shape(n_layer=c.n_layer, d_model=c.d_model, n_head=c.n_head, d_head=c.d_head, d_inner=c.d_inner,
                  tgt_len=T, mem_len=M, batch=B, vocab_size=c.vocab_size)
    hd, K = c.n_head * c.d_head, M + T
    return (flops_per_token(shape, "eval") * T * B + 4 * c.n_layer * c.d_model * hd * M * B
            + 2 * c.n_layer * c.d_model * hd * K)


def engine_part(directory: Path, batches: list[int], repeats: int, S: int) -> dict:
    import txl
    from txl.serve.engine import Model, Unit

    model = txl.from_pretrained(directory)
    c = model.config
    m = Model(model, segment_len=S, mem_len=c.mem_len, same_length=False, clamp_len=0)
    g = torch.Generator().manual_seed(0)
    peak = MatmulPeak(torch.float32, clock=time.thread_time)
    bracket = Bracket(peak)

    def units(B):
        return [Unit("score", torch.randint(0, c.vocab_size, (S,), generator=g).tolist(),
                     torch.randn(c.n_layer, m.mem_len, c.d_model, generator=g),
                     torch.randint(0, c.vocab_size, (S,), generator=g).tolist()) for _ in range(B)]

    def ff(B):  # the forward's first feed-forward matmul, alone: (B T, d) x (d, d_inner)
        x, w = torch.randn(B * S, c.d_model, generator=g), torch.randn(c.d_model, c.d_inner, generator=g)
        torch.mm(x, w)
        t0 = time.thread_time()
        for _ in range(20):
            torch.mm(x, w)
        return 2 * B * S * c.d_model * c.d_inner * 20 / (time.thread_time() - t0)

    m.run("score", units(1))  # warm-up
    rows: dict[int, list[tuple[float, float, float]]] = {B: [] for B in batches}
    for _ in range(repeats):
        for B in batches:
            batch = units(B)
            bracket.start()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            m.run("score", batch)
            cpu, seconds = time.thread_time() - cpu0, time.perf_counter() - t0
            rows[B].append((cpu, forward_flops(c, B, S, m.mem_len) / cpu, bracket.around(), seconds))
    ff_alone = {B: statistics.median(ff(B) for _ in range(repeats)) for B in (batches[0], batches[-1])}
    out = {}
    print(f"-- the read forward alone ({cpu_model()}, threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'B':>3} {'CPU ms':>8} {'tokens/CPU s':>12} {'GFLOP/s':>8} {'peak':>7} {'of peak':>8} {'gain':>6} "
          f"{'wall tokens/s':>13}")
    one = None
    for B in batches:
        seconds, rate, pk, wall = (statistics.median(x[i] for x in rows[B]) for i in range(4))
        share = statistics.median(x[1] / x[2] for x in rows[B])
        one = one or B * S / seconds
        out[B] = {"cpu_ms": seconds * 1e3, "tokens_per_cpu_s": B * S / seconds, "gflops": rate / 1e9,
                  "peak_gflops": pk / 1e9, "of_peak": share, "wall_tokens_per_s": B * S / wall}
        print(f"{B:>3} {seconds * 1e3:8.1f} {B * S / seconds:12.0f} {rate / 1e9:8.1f} {pk / 1e9:7.1f} "
              f"{share:8.1%} {B * S / seconds / one:5.2f}x {B * S / wall:13.0f}")
    best = out[batches[0]]["of_peak"]
    print(f"at B = {batches[0]} the forward runs at {best:.1%} of the matmul peak: batching can gain at most "
          f"{1 / best:.2f}x, if B rows ran at the full peak")
    for B, f in ff_alone.items():
        print(f"the FF matmul ({B * S} x {c.d_model}) x ({c.d_model} x {c.d_inner}) alone: {f / 1e9:.1f} GFLOP/s")
    return {"forward": out, "ff_gflops": {B: f / 1e9 for B, f in ff_alone.items()}}


def _metrics(client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    got = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name.endswith("_sum") or s.name.endswith("_count"):
                label = s.labels.get("kind") or s.labels.get("route") or ""
                got[f"{s.name}{{{label}}}"] = got.get(f"{s.name}{{{label}}}", 0.0) + s.value
    return got


def http_part(directory: Path, work: Path, requests: int, clients: int, S: int) -> dict:
    import concurrent.futures as futures

    import httpx

    from txl.data.tokenizer import load_model_tokenizer
    from txl.serve.session import SessionState, take_text

    text = corpus_text(1_000_000)
    tok = load_model_tokenizer(directory)
    t0 = time.perf_counter()
    for k in range(requests):
        take_text(SessionState(id=""), text[k * S:(k + 1) * S], tok, final=False)
    tokenise = (time.perf_counter() - t0) / requests
    proc, url = start_server(directory, work / "serve.log", "--serve.state_dir", str(work / "state"),
                             "--serve.threads", "1", "--serve.durability", "request", "--serve.segment_len", str(S),
                             "--serve.max_batch", "16")
    result = {"tokenise_ms": tokenise * 1e3}
    try:
        with httpx.Client(base_url=url, timeout=300, limits=httpx.Limits(max_connections=clients + 2)) as c:
            # The first segment and its extra token, untimed: the session's context token (the line break) is one.
            first = S if c.get("/tokenizer_info").json()["eos_token_id"] is not None else S + 1
            for n in (1, clients):
                ids = [c.post("/v1/sessions").json()["id"] for _ in range(n)]
                for k, sid in enumerate(ids):
                    c.post(f"/v1/sessions/{sid}/text", json={"text": text[k * 10000:k * 10000 + first]})
                before = _metrics(c)
                walls: list[float] = []

                def client(k: int, n: int = n, ids: list[str] = ids, walls: list[float] = walls) -> None:
                    at = k * 10000 + first
                    for _ in range(requests // n):
                        t = time.perf_counter()
                        r = c.post(f"/v1/sessions/{ids[k]}/text", json={"text": text[at:at + S]})
                        walls.append(time.perf_counter() - t)
                        r.raise_for_status()
                        at += S

                t0 = time.perf_counter()
                with futures.ThreadPoolExecutor(n) as pool:
                    list(pool.map(client, range(n)))
                elapsed = time.perf_counter() - t0
                after = _metrics(c)
                d = {k: after[k] - before.get(k, 0.0) for k in after}
                done = len(walls)
                row = {"sessions": n, "requests": done, "tokens_per_s": done * S / elapsed,
                       "wall_ms": statistics.mean(walls) * 1e3,
                       "server_ms": d["txl_request_seconds_sum{/v1/sessions/{sid}/text}"] / done * 1e3,
                       "forward_ms": d["txl_forward_seconds_sum{score}"] / done * 1e3,
                       "forwards": d["txl_forward_seconds_count{score}"],
                       "write_ms": d["txl_state_write_seconds_sum{}"] / done * 1e3, "tokenise_ms": tokenise * 1e3}
                row["rest_ms"] = row["wall_ms"] - row["forward_ms"] - row["write_ms"] - row["tokenise_ms"]
                result[n] = row
                print(f"-- {n} client(s), {done} requests of {S} tokens, load average {os.getloadavg()[0]:.1f}: "
                      f"{row['tokens_per_s']:.0f} tokens/s; per request (ms, the server's work divided by the "
                      f"requests): wall {row['wall_ms']:.1f} = forward {row['forward_ms']:.1f} ({row['forwards']:.0f}"
                      f" forwards) + state write {row['write_ms']:.2f} + tokenise {row['tokenise_ms']:.2f} + HTTP, "
                      f"JSON and waiting {row['rest_ms']:.1f} (server-side request time {row['server_ms']:.1f})")
                for sid in ids:
                    c.delete(f"/v1/sessions/{sid}")
    finally:
        proc.terminate()
        proc.wait(60)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parts", nargs="+", default=["forward", "http"], choices=["forward", "http"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    S = 128
    result = {}
    with tempfile.TemporaryDirectory(prefix="txl-serve-read-") as tmp:
        directory = make_model_dir(Path(tmp) / "model")
        if "forward" in args.parts:
            result = engine_part(directory, args.batch, args.repeats, S)
        if "http" in args.parts:
            result["http"] = http_part(directory, Path(tmp), args.requests, args.clients, S)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
