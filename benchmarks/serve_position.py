"""`txl serve`: the cost of reading one more segment into a session, against how much it has read.

A session carries only the model's memory (n_layer x mem_len x d_model), so reading segment k costs the
same at token 100,000 as at token 1,000. This drives the server's own reading path (the engine's
``read_ids`` and its batched forward, without HTTP) on a random small model: one long session reads
``--tokens`` tokens of Tiny Shakespeare a segment at a time; at each checkpoint, ``--repeats`` of its
segments are timed interleaved with segments read by fresh sessions (their second segment: memory just
full), so the machine's noise hits both alike. Prints ms per segment at each position, the ratio to a fresh
session's, and the session's state size.

    python -m benchmarks.serve_position [--tokens 100000] [--segment-len 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def drive(engine, gen):
    """Run a job's generator to the end, one unit at a time; its return value."""
    try:
        unit = next(gen)
        while True:
            [result] = engine.m.run(unit.kind, [unit])
            unit = gen.send(result)
    except StopIteration as stop:
        return stop.value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--segment-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    import os

    import torch

    import txl
    from benchmarks.serve_common import corpus_text, make_model_dir
    from txl.data.tokenizer import load_model_tokenizer
    from txl.serve.engine import Engine, Model
    from txl.serve.session import SessionState, SessionStore

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="txl-serve-position-"))
    model_dir = Path(args.model) if args.model else make_model_dir(work / "model")
    model = txl.from_pretrained(model_dir)
    tok = load_model_tokenizer(model_dir, vocab_size=model.config.vocab_size)
    c, S = model.config, args.segment_len
    m = Model(model, segment_len=S, mem_len=c.mem_len, same_length=c.same_length, clamp_len=c.clamp_len)
    engine = Engine(m, tok, SessionStore(work / "state", max_in_memory=10, ttl=3600), max_queue=1, max_batch=1,
                    durable=False)
    ids = [int(i) for i in tok.encode(corpus_text(args.tokens + 100 * S))]
    session = SessionState(id="long")
    drive(engine, engine.read_ids(session, ids[:1]))  # the first token: its successor is then read a segment at once
    pos = 1
    checkpoints = sorted(c for c in {S, 1000, 10_000, 50_000, args.tokens} if c <= args.tokens)
    rows = []

    def segment(state, start):
        t = time.perf_counter()
        drive(engine, engine.read_ids(state, ids[start:start + S]))
        return time.perf_counter() - t

    fresh_at = len(ids) - 3 * S  # fresh sessions read text of their own, from the end of the corpus
    for target in checkpoints:
        while pos < target:
            segment(session, pos)
            pos += S
        long_t, fresh_t, at = [], [], pos
        for _ in range(args.repeats):
            long_t.append(segment(session, pos))
            pos += S
            fresh = SessionState(id="fresh")
            drive(engine, engine.read_ids(fresh, ids[fresh_at:fresh_at + 1 + S]))  # first segment: memory fills
            fresh_t.append(segment(fresh, fresh_at + 1 + S))
        a, b = statistics.median(long_t) * 1000, statistics.median(fresh_t) * 1000
        state = session.memory.numel() * session.memory.element_size()
        rows.append({"tokens_read": at, "ms_per_segment": a, "fresh_ms_per_segment": b, "ratio": a / b,
                     "state_bytes": state})
        print(f"from {at:>7} tokens read: {a:7.2f} ms/segment, fresh session {b:7.2f} ms ({a / b:.3f}x), "
              f"state {state / 1024:.0f} KiB", flush=True)
    print(json.dumps({"segment_len": S, "mem_len": c.mem_len, "n_layer": c.n_layer, "d_model": c.d_model,
                      "threads": args.threads, "load_average": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
