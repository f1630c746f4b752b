"""Generation speed: the memory cache (one position per new token) vs recomputing the whole window.

For each context length C, a random small model reads a C-token prompt, then draws N tokens greedily:

* cached: ``IncrementalDecoder`` with mem_len = C, a (B, 1) step per token against the memory and its
  key/value cache (the memory rows' keys and values are not projected again);
* recompute: a full forward pass over the last C tokens for every new token (a vanilla Transformer's
  sliding-window evaluation, as in section 4.4 of the paper).

Both attend to C tokens of context per new token. Prints a table and one JSON line per setting.

    python -m benchmarks.generation [--contexts 128 512 1024] [--new-tokens 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import txl
from txl.generation import IncrementalDecoder, inference_context


def small_model(device: str) -> txl.TransformerXL:
    config = txl.ModelConfig(vocab_size=10000, cutoffs=[2000, 6000], div_val=2, n_layer=4, d_model=256,
                             n_head=4, d_head=64, d_inner=1024, mem_len=128, dropout=0.0)
    torch.manual_seed(0)
    return txl.TransformerXL(config).to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cached(model, prompt, n, device) -> float:
    decoder = IncrementalDecoder(model, mem_len=prompt.size(1), segment_len=512)
    log_probs = decoder.feed(prompt)  # the prompt is read once, outside the timing
    sync(device)
    start = time.perf_counter()
    for _ in range(n):
        token = log_probs.argmax(-1)  # (B,)
        log_probs = decoder.feed(token[:, None])  # (B, 1): one position
    sync(device)
    return time.perf_counter() - start


def recompute(model, prompt, n, device) -> float:
    window, ids = prompt.size(1), prompt
    sync(device)
    start = time.perf_counter()
    with inference_context(model, mem_len=0, same_length=False) as context:
        for _ in range(n):
            # (B, C, d): everything again
            hidden = model(ids[:, -window:], return_log_probs=False, context=context).hidden
            token = model.softmax.log_prob(hidden[:, -1]).argmax(-1)  # (B,)
            ids = torch.cat([ids, token[:, None]], dim=1)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (1: steady timings on a shared machine; small ops gain nothing from more)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = small_model(args.device)
    n = args.new_tokens
    rows = []
    for context in args.contexts:
        prompt = torch.randint(0, model.config.vocab_size, (args.batch_size, context), device=args.device)
        cached(model, prompt[:, :16], 2, args.device)  # warm up
        t_cached = cached(model, prompt, n, args.device)
        t_full = recompute(model, prompt, n, args.device)
        row = dict(context=context, new_tokens=n, batch_size=args.batch_size, device=args.device,
                   threads=args.threads,
                   cached_tok_s=args.batch_size * n / t_cached, recompute_tok_s=args.batch_size * n / t_full,
                   speedup=t_full / t_cached)
        rows.append(row)
    print(f"{'context':>8} {'cached tok/s':>13} {'recompute tok/s':>16} {'speed-up':>9}")
    for r in rows:
        print(f"{r['context']:>8} {r['cached_tok_s']:>13.1f} {r['recompute_tok_s']:>16.1f} {r['speedup']:>8.1f}x")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
