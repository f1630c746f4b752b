"""Recurrence as an end-to-end test: does the memory carry information a model can use?

A tiny model (2 layers, d_model 32) is trained on the recall task (``txl.data.recall``: ``k=v ... k v``,
one key at a time, 4 values, 4 filler words) with segments of --tgt-len 8 tokens and distances 3 to 6, and
scored on held-out answers split in two: those whose definition lies in an *earlier segment* than the query
(no query can see it without memory) and those in the *same segment*. Trained the same way (same data, seed,
steps, a plain loop), the model with a memory of --mem-len 16 should answer both well above chance (1 / 4);
the model without memory should answer the same-segment ones (it learned the task) and stay at chance on the
earlier-segment ones. Exit status 0 when that holds, 1 when not.

    python -m experiments.recurrence                 # two trainings of 400 steps; exit 1 if the check fails
    python -m experiments.recurrence --steps 30      # too short to learn: exit 1

Initialisation: normal(0, --init-std = 0.1) for every weight (``ModelConfig.init_std``/``proj_init_std``). With
the original's 0.02/0.01 the attention scores start near zero and the matching key gets almost no gradient: the
models stayed on the associative-recall plateau, at chance, for thousands of steps (issue 25's closing note has
the measurements); with 0.1 this setting passes from 400 steps on seeds 0-3 (about 4 s per training on one
core). ``tests/test_recurrence.py`` runs the default in the suite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np
import torch

import txl
from txl.data.recall import RecallParams, answers, definition, generate


class _Words:
    """The vocabulary of the generated words (what ``answers`` reads: ``tokenizer.vocab.index``)."""

    def __init__(self, words: list[str]) -> None:
        self.index = {w: i for i, w in enumerate(sorted(set(words)))}

    @property
    def vocab(self) -> _Words:
        return self

    def encode(self, words: list[str]) -> np.ndarray:
        return np.array([self.index[w] for w in words], dtype=np.int64)


def train_and_score(mem_len: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one tiny model with memory ``mem_len`` on the recall stream; its answer accuracy on held-out text."""
    params = RecallParams(n_keys=1, n_values=args.values, n_filler=4, min_distance=args.min_distance,
                          max_distance=args.max_distance, define_rate=args.define_rate, tokens=(0, 0, 0),
                          seed=args.seed)
    B, T = args.batch_size, args.tgt_len
    train_words, valid_words = generate(B * T * args.steps + 1, params, 0), generate(args.valid_tokens, params, 1)
    words = _Words([f"f{i}" for i in range(params.n_filler)] + [f"v{i}" for i in range(args.values)]
                   + ["k0"] + [definition(0, i) for i in range(args.values)])
    train, valid = words.encode(train_words), words.encode(valid_words)
    torch.manual_seed(args.seed)
    model = txl.TransformerXL(txl.ModelConfig(vocab_size=len(words.index), n_layer=2, d_model=args.d_model,
                                              n_head=2, d_inner=2 * args.d_model, mem_len=mem_len, dropout=0.0,
                                              init_std=args.init_std, proj_init_std=args.init_std))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    L = (len(train) - 1) // B
    x = torch.as_tensor(train[:B * L]).view(B, L)  # (B, L)
    y = torch.as_tensor(train[1:B * L + 1]).view(B, L)  # (B, L): y[:, t] follows x[:, t]
    memory, start = None, time.perf_counter()
    for s in range(0, args.steps * T, T):
        out = model(x[:, s:s + T], labels=y[:, s:s + T], memory=memory)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        memory = out.memory
    train_s = time.perf_counter() - start
    positions, distances = answers(valid, words)
    S = 4
    Lv = (len(valid) - 1) // S
    xv, yv = torch.as_tensor(valid[:S * Lv]).view(S, Lv), torch.as_tensor(valid[1:S * Lv + 1]).view(S, Lv)
    hits, memory = [], None
    model.eval()
    with torch.no_grad():
        for s in range(0, Lv, T):
            out = model(xv[:, s:s + T], memory=memory)
            memory = out.memory
            hits.append(out.log_probs.argmax(-1) == yv[:, s:s + T])  # (S, T)
    hit = torch.cat(hits, 1).reshape(-1).numpy()  # stream after stream: token p is predicted at index p - 1
    # The answer's token p is predicted at input p - 1; its definition's value stands at p - d. Answers whose
    # definition lies in an earlier segment than that query cannot be seen without memory.
    stream = (positions - 1) // Lv
    same_stream = ((positions - 1) < S * Lv) & (stream == (positions - distances) // Lv)
    query_seg = (positions - 1 - stream * Lv) // T
    definition_seg = (positions - distances - stream * Lv) // T
    out: dict[str, Any] = {"mem_len": mem_len, "train_s": train_s}
    for name, keep in (("earlier_segment", same_stream & (definition_seg < query_seg)),
                       ("same_segment", same_stream & (definition_seg == query_seg))):
        acc = float(hit[positions[keep] - 1].mean())
        out[name] = {"accuracy": acc, "se": math.sqrt(acc * (1 - acc) / max(1, keep.sum())),
                     "answers": int(keep.sum())}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.recurrence", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tgt-len", type=int, default=8)
    p.add_argument("--mem-len", type=int, default=16)
    p.add_argument("--min-distance", type=int, default=3)
    p.add_argument("--max-distance", type=int, default=6)
    p.add_argument("--values", type=int, default=4)
    p.add_argument("--define-rate", type=float, default=0.3, help="chance a free position starts a definition")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init-std", type=float, default=0.1, help="std of every initial weight (the original's: 0.02)")
    p.add_argument("--valid-tokens", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_distance < 2:
        raise SystemExit(f"--max-distance {args.max_distance}: give at least 2 (a definition takes 3 words)")
    torch.set_num_threads(args.threads)
    chance = 1.0 / args.values
    with_memory, without = train_and_score(args.mem_len, args), train_and_score(0, args)
    far, near = with_memory["earlier_segment"], without["earlier_segment"]
    passed = (far["accuracy"] > chance + 0.25  # clearly above chance with memory ...
              and abs(near["accuracy"] - chance) < 4 * near["se"] + 0.05  # ... and near it without,
              and without["same_segment"]["accuracy"] > chance + 0.25)  # though that model learned the task
    print(json.dumps({"chance": chance, "with_memory": with_memory, "without_memory": without, "passed": passed}))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
