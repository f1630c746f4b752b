"""What each kept CPU kernel buys, A/B against the plain ops it replaces (issue 45's rule: >= 3% of a phase).

    OMP_NUM_THREADS=1 python -m benchmarks.kernels_ab            # small and base (~3 min here)
    OMP_NUM_THREADS=1 python -m benchmarks.kernels_ab --shapes small

Each line times one layer's op both ways (process CPU time, one thread, the two sides interleaved, medians), and
scales it to a step: the difference times the layers that run it, against the step time measured here with the
kernel. CPU time, so that other work on a busy machine counts less.

* realign: ``kernels.realign`` (``_Realign``, a strided view with an exact backward) against ``rel_shift``'s
  pad-and-view with the scale and the mask as plain ops, on one layer's positional scores (H, B, T, K);
* gap dropout: ``dropout_impl='fast'`` (``_GapDropout``) against ``nn.Dropout`` ('torch'), a whole training step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import txl
from benchmarks import run as bench
from txl.model import kernels
from txl.model.positions import rel_shift


def plain_realign(scores: torch.Tensor, mask_bias: torch.Tensor, *, heads_first: bool, scale: float = 1.0):
    shifted = rel_shift(scores)  # (H, B, T, K)
    shifted = shifted.transpose(0, 1) if heads_first else shifted  # (B, H, T, K)
    return (shifted * scale + mask_bias).contiguous()  # (B, H, T, K)


def interleaved(sides: dict, rounds: int) -> dict[str, float]:
    """Median CPU seconds of each side's callable, the sides alternating in order; the first round warms up."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds + 1):
        for name in (names if r % 2 else names[::-1]):
            t0 = time.process_time()
            sides[name]()
            if r:
                times[name].append(time.process_time() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def train_step(model: txl.TransformerXL, x: torch.Tensor, memory) -> None:
    model.zero_grad(set_to_none=True)
    model(x[:, :-1], labels=x[:, 1:], memory=memory).loss.backward()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["small", "base"], choices=["small", "base"])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for name in args.shapes:
        measure(name, args.rounds)


def measure(name: str, rounds: int) -> None:
    """Print the three A/Bs at one benchmark shape."""
    shape = bench.SHAPES[name]
    H, B, T, M = shape.n_head, shape.batch, shape.tgt_len, shape.mem_len
    K = M + T
    model = bench.build_model(shape).train()
    x = torch.randint(0, shape.vocab_size, (B, T + 1))
    memory = model.init_memory(B, M)
    step = interleaved({"step": lambda: train_step(model, x, memory)}, 2)["step"]
    scores = torch.randn(H, B, T, K)
    mask_bias = torch.zeros(T, K).masked_fill(torch.ones(T, K, dtype=torch.bool).triu(1 + M), float("-inf"))
    grad = torch.randn(B, H, T, K)

    def fwd_bwd(fn):
        s = scores.clone().requires_grad_()
        fn(s, mask_bias, heads_first=True, scale=0.125).backward(grad)

    t = interleaved({"kernel": lambda: fwd_bwd(kernels.realign), "plain": lambda: fwd_bwd(plain_realign)},
                    rounds)
    saved = (t["plain"] - t["kernel"]) * shape.n_layer
    print(f"{name}: realign fwd+bwd a layer {1e3 * t['kernel']:.1f} ms, plain ops {1e3 * t['plain']:.1f} ms: "
          f"{1e3 * saved:.0f} ms of a {1e3 * step:.0f} ms training step ({100 * saved / step:.1f}%)")
    with torch.no_grad():
        t = interleaved({"kernel": lambda: kernels.realign(scores, mask_bias, heads_first=True, scale=0.125),
                         "plain": lambda: plain_realign(scores, mask_bias, heads_first=True, scale=0.125)},
                        rounds)
    print(f"{name}: realign forward a layer {1e3 * t['kernel']:.1f} ms, plain ops {1e3 * t['plain']:.1f} ms: "
          f"{1e3 * (t['plain'] - t['kernel']) * shape.n_layer:.0f} ms a step (evaluation)")
    models = {impl: bench.build_model(shape, dropout_impl=impl).train()
              for impl in ("fast", "torch")}
    t = interleaved({impl: (lambda m=m: train_step(m, x, memory)) for impl, m in models.items()},
                    max(2, rounds // 2))
    print(f"{name}: training step, dropout 'fast' (gaps) {1e3 * t['fast']:.0f} ms, 'torch' (nn.Dropout) "
          f"{1e3 * t['torch']:.0f} ms: {t['torch'] / t['fast']:.3f}x")


if __name__ == "__main__":
    main()
