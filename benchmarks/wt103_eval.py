"""How long `txl eval --checkpoint transfo-xl-wt103 --corpus wt103 --split test` takes on this machine: an
estimate from the measured speed of the published checkpoint's shape with random weights (its weights are
not needed to time it, and no download is made).

    python benchmarks/wt103_eval.py                 # 3 timed segments after 1 untimed, batch 10
    python benchmarks/wt103_eval.py --segments 5 --threads 2

The shape is the Hugging Face `transfo-xl-wt103` config (18 layers, d_model 1024, 16 heads of 64, d_inner 4096,
adaptive softmax over 267,735 words with cutoffs 20k/40k/200k, div_val 4) in the paper's evaluation context
(tgt_len 128, mem_len 1600, clamp_len 1000, same_length), with a full memory of 1600 random states, as every
segment after the 13th sees, and the key/value cache that txl.evaluate carries (the first, untimed, segment
fills it); the estimate is the WikiText-103 test split's 245,569 tokens at that speed.
"""

from __future__ import annotations

import argparse
import time

import torch

import txl
from txl.convert.hf import config_from_hf

WT103_HF_CONFIG = {"vocab_size": 267735, "cutoffs": [20000, 40000, 200000], "tie_projs": [False, True, True, True],
                   "d_model": 1024, "d_embed": 1024, "d_head": 64, "d_inner": 4096, "div_val": 4, "n_layer": 18,
                   "n_head": 16, "mem_len": 1600, "same_length": True, "clamp_len": 1000, "dropout": 0.0,
                   "dropatt": 0.0, "untie_r": True, "pre_lnorm": False}
TEST_TOKENS = 245_569  # wiki.test.tokens with one <eos> per line (4,358 lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--tgt-len", type=int, default=128)
    parser.add_argument("--segments", type=int, default=3, help="timed segments (after one untimed)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = txl.TransformerXL(config_from_hf(WT103_HF_CONFIG)).to(args.device).eval()
    B, T, M = args.batch_size, args.tgt_len, model.config.mem_len
    memory = [torch.randn(B, M, model.config.d_model, device=args.device) for _ in range(model.config.n_layer)]
    times, cpu_times = [], []
    cache = model.start_kv_cache()  # as txl.evaluate: the memory rows' keys and values are projected once
    with torch.no_grad():
        for i in range(args.segments + 1):
            x = torch.randint(0, model.config.vocab_size, (B, T + 1), device=args.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            # The memory stays full: M rows in, M out. The first, untimed, segment fills the cache.
            out = model(x[:, :-1], labels=x[:, 1:], memory=memory, kv_cache=cache)
            cache = out.kv_cache
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
            memory = out.memory
    per_segment = sorted(times)[len(times) // 2]
    cpu = sorted(cpu_times)[len(cpu_times) // 2]
    rate = B * T / per_segment
    threads = torch.get_num_threads()
    print(f"wt103 shape, batch {B}, tgt_len {T}, mem_len {M}, {threads} threads on {args.device}: "
          f"{per_segment:.2f} s per segment (median of {len(times)}), {rate:,.0f} tokens/s; "
          f"{cpu:.2f} CPU-seconds per segment")
    print(f"estimated test-split evaluation ({TEST_TOKENS:,} tokens): {TEST_TOKENS / rate / 60:,.1f} minutes "
          f"at this wall-clock rate; {TEST_TOKENS / (B * T) * cpu / threads / 60:,.1f} minutes if the "
          f"{threads} threads had the cores to themselves (CPU time / threads)")


if __name__ == "__main__":
    main()
