"""Throughput, memory, FLOPs, MFU and the evaluation speed-up over a vanilla Transformer, in one command.

    python benchmarks/run.py                       # small and base, fp32 and bf16, speed-up table, plot
    python benchmarks/run.py --shapes small --dtypes fp32 --steps 5

Every measured phase (train or eval, per shape and dtype; the speed-up sweep) runs in a fresh
subprocess, so its peak resident memory (ru_maxrss) is its own. Each subprocess also measures this
machine's matmul peak (a 2048-cubed torch.mm in the phase's dtype and thread count) before the first
timed step and after every one, and MFU is the median over steps of each step's achieved FLOP/s over
the mean of the two peak samples around it: on a shared or frequency-scaling machine the step and its
peak are measured under the same conditions.

Printed: a table per section, then one JSON line per measurement; results.jsonl and speedup.png are
written to --out.

Evaluation carries the key/value cache as ``txl.evaluate`` does: the memory rows' keys and values are
those projected in the previous segment, not projected again.

FLOPs per token are counted analytically (no profiler): with N the non-embedding matmul parameters
(per layer q/k/v, output, and the two feed-forward matrices), L layers, H*D attention width and K = M + T
keys per query,

    train = 6 N + 3 * 6 L (H D) K     eval = 2 N + 6 L (H D) K

where 6 L (H D) K is the forward cost of the three K-long attention products per query: the content
score (q + u) k^T, the positional score (q + v) R^T, and the weighted sum of values. The causal mask
is not subtracted (every score is computed). Work the implementation does on top of this -- in training
the keys and values of the memory rows and the attention scores recomputed in backward; the W_kR
projection of R, the softmax layer -- is not counted, as MFU conventionally leaves out recomputation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the library of this checkout, not an installed copy

import torch  # noqa: E402

import txl  # noqa: E402
from txl.config import OptimConfig  # noqa: E402
from txl.optim import build_optimizer  # noqa: E402
from txl.runtime import cpu_has_native_bf16, retain_freed_memory  # noqa: E402


@dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    d_inner: int
    tgt_len: int
    mem_len: int
    batch: int
    vocab_size: int = 204  # byte-level: 256 bytes less the unused, as enwik8's 204 symbols
    dropout: float = 0.1


SHAPES = {
    "tiny": Shape(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, tgt_len=16, mem_len=16, batch=2),
    "small": Shape(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=128, mem_len=128, batch=8),
    "base": Shape(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, tgt_len=256, mem_len=256, batch=4),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASES = ("train", "train-keep", "eval")
# Dai et al. 2019, Table 9: evaluation speed-up over Al-Rfou et al. (2018) on a GPU, by attention length.
PAPER_SPEEDUP = {800: 363, 1800: 773, 2800: 1409, 3800: 1874}
PEAK_N = 2048


def model_config(shape: Shape, **changes) -> txl.ModelConfig:
    fields = dict(vocab_size=shape.vocab_size, n_layer=shape.n_layer, d_model=shape.d_model, n_head=shape.n_head,
                  d_head=shape.d_head, d_inner=shape.d_inner, mem_len=shape.mem_len, dropout=shape.dropout)
    fields.update(changes)
    return txl.ModelConfig(**fields)


# -- FLOP counts ---------------------------------------------------------------------------------------
def matmul_params(shape: Shape) -> int:
    """N: non-embedding matmul parameters (q/k/v, output projection, feed-forward) of all layers."""
    hd = shape.n_head * shape.d_head
    return shape.n_layer * (3 * shape.d_model * hd + hd * shape.d_model + 2 * shape.d_model * shape.d_inner)


def attention_flops(shape: Shape, klen: int, positional: bool = True) -> int:
    """Forward FLOPs per query of the K-long products: score, positional score (if any), values."""
    products = 3 if positional else 2
    return products * 2 * shape.n_layer * shape.n_head * shape.d_head * klen


def flops_per_token(shape: Shape, phase: str) -> int:
    klen = shape.mem_len + shape.tgt_len
    n, attn = matmul_params(shape), attention_flops(shape, klen)
    return 6 * n + 3 * attn if phase.startswith("train") else 2 * n + attn


def speedup_flop_ratio(shape: Shape, length: int) -> float:
    """Executed forward FLOPs per predicted token: a vanilla model slid over L-token windows against
    Transformer-XL with T = M = L, counting here W_kR R as well (the memory rows' keys and values come from
    the key/value cache of the previous segment, as in ``txl.evaluate``)."""
    hd = shape.n_head * shape.d_head
    n = matmul_params(shape)
    vanilla = 2 * n * length + length * attention_flops(shape, length, positional=False)  # one window
    klen = 2 * length
    xl = (2 * n + attention_flops(shape, klen)  # per segment token
          + shape.n_layer * 2 * shape.d_model * hd * klen / length)  # W_kR R, once per segment (batch 1)
    return vanilla / xl


# -- measurement helpers -------------------------------------------------------------------------------
class MatmulPeak:
    """This machine's matmul FLOP/s: an n-cubed torch.mm (PEAK_N by default) in one dtype, timed on demand.

    The phases sample it around every timed step (``Bracket``), so each step's FLOP/s is divided by a peak
    measured on the same (shared, noisy) machine moments before and after; the operands (3 x 16 MB in fp32)
    stay allocated.
    """

    def __init__(self, dtype: torch.dtype, clock=time.perf_counter, n: int = PEAK_N) -> None:
        self.clock, self.n = clock, n
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=g).to(dtype)
        self.b = torch.randn(n, n, generator=g).to(dtype)
        self.c = torch.mm(self.a, self.b)  # also the warm-up

    def sample(self) -> float:
        t0 = self.clock()
        torch.mm(self.a, self.b, out=self.c)
        return 2 * self.n**3 / (self.clock() - t0)


class Bracket:
    """Peak samples around the timed steps: one before the first, one after each; a step gets their mean."""

    def __init__(self, peak: MatmulPeak) -> None:
        self.peak, self.last = peak, None

    def around(self) -> float:
        """Call right after a timed step: the mean of the samples before and after it."""
        after = self.peak.sample()
        before, self.last = self.last, after
        return (before + after) / 2

    def start(self) -> None:
        """Call right before the first timed step."""
        self.last = self.peak.sample()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def batches(shape: Shape, n: int, generator: torch.Generator):
    """n random byte-level (input, label) segments of one stream per batch row, in order."""
    stream = torch.randint(0, shape.vocab_size, (shape.batch, n * shape.tgt_len + 1), generator=generator)
    for s in range(n):
        lo = s * shape.tgt_len
        yield stream[:, lo:lo + shape.tgt_len], stream[:, lo + 1:lo + shape.tgt_len + 1]


def autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def train_step(model, optimizer, x, y, memory, dtype, clip: float = 0.25, clock=time.perf_counter):
    """One optimizer step with memory carried; returns the new memory and the seconds of each part."""
    t0 = clock()
    with autocast(dtype):
        out = model(x, labels=y, memory=memory)
    t1 = clock()
    out.loss.backward()
    t2 = clock()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = clock()
    return out.memory, dict(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2, step=t3 - t0)


def same_batch_loss(model, x, y, memory, dtype, seed: int) -> float:
    """Training-mode loss of one batch with a fixed dropout seed (no update)."""
    torch.manual_seed(seed)
    with torch.no_grad(), autocast(dtype):
        return model(x, labels=y, memory=memory).loss.item()


def bf16_loss_check(model, x, y, memory) -> dict:
    """bf16 autocast against fp32 on the same batch, weights and dropout seed: both losses and their difference."""
    fp32 = same_batch_loss(model, x, y, memory, torch.float32, seed=1)
    bf16 = same_batch_loss(model, x, y, memory, torch.bfloat16, seed=1)
    return dict(loss_fp32=fp32, loss_bf16=bf16, loss_diff=abs(bf16 - fp32))


def worker_train(shape: Shape, dtype: torch.dtype, warmup: int, steps: int, peak: MatmulPeak, *,
                 recompute: bool = True) -> tuple[list[dict], dict]:
    """Timed training steps (forward, backward, clipped Adam step, memory carried), peak samples around each."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = txl.TransformerXL(model_config(shape, recompute_attention=recompute)).train()
    optimizer = build_optimizer(model, OptimConfig(lr=2.5e-4))  # the trainer's optimiser (fused Adam)
    memory, samples, extra, bracket = None, [], {}, Bracket(peak)
    for i, (x, y) in enumerate(batches(shape, warmup + steps, gen)):
        if i == warmup and dtype == torch.bfloat16:
            extra = bf16_loss_check(model, x, y, memory)
        if i == warmup:
            bracket.start()
        memory, t = train_step(model, optimizer, x, y, memory, dtype, clock=peak.clock)
        if i >= warmup:
            samples.append(dict(t, peak=bracket.around()))
    return samples, extra


def worker_eval(shape: Shape, dtype: torch.dtype, warmup: int, steps: int, peak: MatmulPeak) -> tuple[list[dict], dict]:
    """Timed evaluation segments (per-token NLL, memory and key/value cache carried), peak samples around each.

    As ``txl.evaluate``: the memory rows' keys and values come from the previous segment's cache instead of
    being projected again (the weights do not change in evaluation).
    """
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = txl.TransformerXL(model_config(shape)).eval()
    memory, cache, samples, bracket = None, txl.KVCache(), [], Bracket(peak)
    for i, (x, y) in enumerate(batches(shape, warmup + steps, gen)):
        if i == warmup:
            bracket.start()
        t0 = peak.clock()
        with torch.inference_mode(), autocast(dtype):
            out = model(x, labels=y, memory=memory, kv_cache=cache)
        out.nll.sum().item()
        step = peak.clock() - t0
        if i >= warmup:
            samples.append(dict(step=step, peak=bracket.around()))
        memory, cache = out.memory, out.kv_cache
    return samples, {}


@torch.inference_mode()
def worker_speedup(shape: Shape, lengths: list[int], reps: int) -> list[dict]:
    """Per-token evaluation time: Transformer-XL (T = M = L) against a vanilla model slid over L-token windows.

    The vanilla model is Al-Rfou et al.'s: learned absolute positions added at every layer, no memory;
    each window of L tokens predicts only its last token. Both sides run batch 1 and are timed in turn,
    rep by rep, so both see the same machine.
    """
    rows = []
    gen = torch.Generator().manual_seed(0)
    for length in lengths:
        torch.manual_seed(0)
        xl = txl.TransformerXL(model_config(shape, mem_len=length, dropout=0.0)).eval()
        vanilla = txl.TransformerXL(model_config(shape, mem_len=0, dropout=0.0, attn_type="al_rfou",
                                                 learned_positions=length)).eval()
        tokens = torch.randint(0, shape.vocab_size, (1, (reps + 3) * length + 1), generator=gen)
        first = xl(tokens[:, :length], kv_cache=txl.KVCache())  # a full memory (and its keys) from here on
        memory, cache = first.memory, first.kv_cache
        window = tokens[:, :length]
        vanilla(window)  # warm-up
        t_xl, t_vanilla = [], []
        for r in range(reps + 1):  # the first rep warms up the XL shape with memory
            seg = tokens[:, (r + 1) * length:(r + 2) * length]
            t0 = time.perf_counter()
            out = xl(seg, memory=memory, kv_cache=cache, return_log_probs=True)  # as txl.evaluate
            memory, cache = out.memory, out.kv_cache
            t1 = time.perf_counter()
            window = tokens[:, r + 1:r + 1 + length]  # slid by one token
            vanilla(window, return_log_probs=True).log_probs[:, -1]
            t2 = time.perf_counter()
            if r:
                t_xl.append((t1 - t0) / length)
                t_vanilla.append(t2 - t1)
        xl_tok, van_tok = statistics.median(t_xl), statistics.median(t_vanilla)
        rows.append(dict(length=length, xl_ms_per_token=1e3 * xl_tok, vanilla_ms_per_token=1e3 * van_tok,
                         speedup=van_tok / xl_tok, flop_ratio=speedup_flop_ratio(shape, length),
                         paper=PAPER_SPEEDUP.get(length)))
    return rows


def worker_bf16_check(shape: Shape) -> dict:
    """On a CPU without bf16 matrix instructions: the bf16-vs-fp32 loss check alone, and the two mm speeds.

    The loss check runs the same batch (after one segment of memory) in fp32 and under bf16 autocast; no
    phase is timed, since bf16 matmuls run through scalar or conversion paths there.
    """
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = txl.TransformerXL(model_config(shape)).train()
    (x0, y0), (x, y) = batches(shape, 2, gen)
    with torch.no_grad():
        memory = model(x0, labels=y0).memory
    t0 = time.perf_counter()
    check = bf16_loss_check(model, x, y, memory)
    check_s = time.perf_counter() - t0
    speeds = {f"mm_flops_{name}": MatmulPeak(dtype, n=512).sample() for name, dtype in DTYPES.items()}  # 2048: minutes
    return dict(check, check_s=check_s, **speeds)


def run_worker(args) -> None:
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as the txl command does
    shape = SHAPES[args.shape]
    if args.worker == "bf16check":
        print(json.dumps(dict(kind="bf16check", shape=args.shape, threads=args.threads, **worker_bf16_check(shape))))
        return
    if args.worker == "speedup":
        rows = worker_speedup(shape, args.lengths, args.reps)
        print(json.dumps(dict(kind="speedup", shape=args.shape, threads=args.threads, rows=rows,
                              peak_rss_mb=peak_rss_mb())))
        return
    dtype = DTYPES[args.dtype]
    peak = MatmulPeak(dtype, time.process_time if args.clock == "cpu" else time.perf_counter)
    t0 = time.perf_counter()
    if args.worker == "eval":
        samples, extra = worker_eval(shape, dtype, args.warmup, args.steps, peak)
    else:  # 'train' recomputes the attention scores in backward (the default), 'train-keep' keeps them
        samples, extra = worker_train(shape, dtype, args.warmup, args.steps, peak, recompute=args.worker == "train")
    wall = time.perf_counter() - t0
    tokens = shape.batch * shape.tgt_len
    fpt = flops_per_token(shape, args.worker)
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    mfu = statistics.median(fpt * tokens / s["step"] / s["peak"] for s in samples)  # each step by the peaks around it
    print(json.dumps(dict(kind=args.worker, shape=args.shape, dtype=args.dtype, threads=args.threads, clock=args.clock,
                          steps=len(samples), tokens_per_step=tokens,
                          tokens_per_s=tokens / med["step"], flops_per_token=fpt,
                          achieved_flops=fpt * tokens / med["step"], peak_flops=med["peak"], mfu=mfu,
                          peak_rss_mb=peak_rss_mb(), phase_wall_s=wall,
                          **{f"{k}_s": v for k, v in med.items() if k != "peak"}, **extra)))


# -- driver --------------------------------------------------------------------------------------------
def spawn(args, *extra: str) -> list[dict]:
    cmd = [sys.executable, __file__, "--threads", str(args.threads), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"benchmark worker failed: {' '.join(cmd)}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def spawn_repeated(args, *extra: str) -> list[dict]:
    """``args.repeats`` fresh runs of one phase; the run with the median MFU stands for them, with every run's
    MFU, tokens/s and peak memory attached (a noisy machine moves single runs by 10% and more)."""
    runs = [r for _ in range(args.repeats) for r in spawn(args, *extra)]
    if len(runs) == 1:
        return runs
    median = sorted(runs, key=lambda r: r["mfu"])[len(runs) // 2]
    spread = {f"{k}_runs": [r[k] for r in runs] for k in ("mfu", "tokens_per_s", "peak_rss_mb")}
    return [dict(median, repeats=len(runs), **spread)]


def print_tables(results: list[dict]) -> None:
    runs = [r for r in results if r["kind"] in PHASES]
    if runs:
        head = (f"{'shape':<6} {'dtype':<5} {'phase':<10} {'tok/s':>8} {'step ms':>8} {'fwd':>6} {'bwd':>6} "
                f"{'opt':>5} {'MFLOP/tok':>9} {'GFLOP/s':>8} {'peak':>6} {'MFU':>5} {'RSS MB':>7}")
        print(head)
        print("-" * len(head))
        for r in runs:
            ms = {k: f"{1e3 * r[k + '_s']:.0f}" if k + "_s" in r else "" for k in ("forward", "backward", "optimizer")}
            print(f"{r['shape']:<6} {r['dtype']:<5} {r['kind']:<10} {r['tokens_per_s']:>8.0f} "
                  f"{1e3 * r['step_s']:>8.0f} {ms['forward']:>6} {ms['backward']:>6} {ms['optimizer']:>5} "
                  f"{r['flops_per_token'] / 1e6:>9.1f} {r['achieved_flops'] / 1e9:>8.1f} "
                  f"{r['peak_flops'] / 1e9:>6.0f} {r['mfu']:>5.2f} {r['peak_rss_mb']:>7.0f}")
        for r in runs:
            if "mfu_runs" in r:
                print(f"{r['shape']} {r['dtype']} {r['kind']}: {r['repeats']} runs, MFU "
                      + " ".join(f"{m:.2f}" for m in sorted(r["mfu_runs"]))
                      + ", peak RSS MB " + " ".join(f"{m:.0f}" for m in sorted(r["peak_rss_mb_runs"]))
                      + " (the median-MFU run is in the table)")
        for r in runs:
            if "loss_diff" in r:
                print(f"{r['shape']} bf16 autocast loss {r['loss_bf16']:.5f} vs fp32 {r['loss_fp32']:.5f} on the "
                      f"same batch: |diff| = {r['loss_diff']:.2e}")
        for shape in {r["shape"] for r in runs}:
            by = {(r["dtype"], r["kind"]): r["tokens_per_s"] for r in runs if r["shape"] == shape}
            for kind in PHASES:
                if ("fp32", kind) in by and ("bf16", kind) in by:
                    print(f"{shape} {kind}: bf16 autocast / fp32 tokens/s = {by['bf16', kind] / by['fp32', kind]:.2f}x")
    for r in (r for r in results if r["kind"] == "bf16check"):
        print(f"{r['shape']} bf16: not timed, this CPU has no bf16 matrix instructions (AVX512_BF16 or AMX): a "
              f"512-cubed mm runs at {r['mm_flops_bf16'] / 1e9:.1f} GFLOP/s in bf16 against "
              f"{r['mm_flops_fp32'] / 1e9:.0f} in fp32 (--force-bf16 times it anyway). Same batch: bf16 autocast "
              f"loss {r['loss_bf16']:.5f} vs fp32 {r['loss_fp32']:.5f}, |diff| = {r['loss_diff']:.2e}")
    for r in (r for r in results if r["kind"] == "speedup"):
        print(f"\nevaluation speed-up over a vanilla Transformer slid one token at a time ({r['shape']} widths, "
              f"batch 1, fp32, XL with T = M = L)")
        head = (f"{'L':>5} {'XL ms/tok':>10} {'vanilla ms/tok':>15} {'speed-up':>9} {'FLOP ratio':>11} "
                f"{'paper (GPU)':>12}")
        print(head)
        print("-" * len(head))
        for row in r["rows"]:
            paper = f"{row['paper']}x" if row["paper"] else ""
            print(f"{row['length']:>5} {row['xl_ms_per_token']:>10.3f} {row['vanilla_ms_per_token']:>15.2f} "
                  f"{row['speedup']:>8.0f}x {row['flop_ratio']:>10.0f}x {paper:>12}")
        print("paper, Table 9: " + ", ".join(f"{v}x at {k}" for k, v in PAPER_SPEEDUP.items()))


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in (r for r in results if r["kind"] == "speedup"):
        lengths = [row["length"] for row in r["rows"]]
        ax1.plot(lengths, [row["speedup"] for row in r["rows"]], "o-", label=f"measured, CPU ({r['shape']})")
        ax1.plot(lengths, [row["flop_ratio"] for row in r["rows"]], "s--", label="FLOP ratio")
    ax1.plot(list(PAPER_SPEEDUP), list(PAPER_SPEEDUP.values()), "^:", label="paper, Table 9 (GPU)")
    ax1.set(xscale="log", yscale="log", xlabel="attention length L", ylabel="speed-up over vanilla",
            title="Evaluation speed-up")
    ticks = sorted({row["length"] for r in results if r["kind"] == "speedup" for row in r["rows"]} | set(PAPER_SPEEDUP))
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax1.legend()
    runs = [r for r in results if r["kind"] in PHASES]
    labels = [f"{r['shape']}\n{r['dtype']} {r['kind']}" for r in runs]
    ax2.bar(range(len(runs)), [r["mfu"] for r in runs])
    ax2.set_xticks(range(len(runs)), labels, fontsize=7)
    ax2.set(ylabel="MFU (of the same-dtype 2048^3 mm)", title="Model FLOP utilisation", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["small", "base"], choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES),
                   help="train: the default (attention recomputed in backward); train-keep: "
                        "recompute_attention=False, probabilities kept; eval: evaluation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--steps", type=int, default=7, help="timed steps; medians are reported")
    p.add_argument("--repeats", type=int, default=1,
                   help="fresh runs of each train/eval phase; the median-MFU run is reported with the spread")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: time by process CPU time, steadier on a shared machine; use with --threads 1")
    p.add_argument("--lengths", nargs="*", type=int, default=[128, 256, 512, 800, 1600],
                   help="attention lengths of the speed-up sweep (none: skip it)")
    p.add_argument("--speedup-shape", default="small", choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=3, help="timed segments / windows per length")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--force-bf16", action="store_true",
                   help="time the bf16 phases even on a CPU without bf16 matrix instructions (very slow there)")
    p.add_argument("--worker", choices=[*PHASES, "speedup", "bf16check"], help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args)

    t0 = time.perf_counter()
    results = []
    common = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--clock", args.clock]
    dtypes = list(args.dtypes)
    if "bf16" in dtypes and not args.force_bf16 and cpu_has_native_bf16() is False:
        # bf16 matmuls without AVX512_BF16/AMX run through scalar or conversion paths, ~100x slower than fp32:
        # timing them says nothing about this implementation. The loss check is still made.
        dtypes.remove("bf16")
        for shape in args.shapes:
            results += spawn(args, "--worker", "bf16check", "--shape", shape)
    for shape in args.shapes:
        for dtype in dtypes:
            for phase in args.phases:
                results += spawn_repeated(args, "--worker", phase, "--shape", shape, "--dtype", dtype, *common)
    if args.lengths:
        results += spawn(args, "--worker", "speedup", "--shape", args.speedup_shape, "--reps", str(args.reps),
                         "--lengths", *map(str, args.lengths))
    print_tables(results)
    print()
    for r in results:
        print(json.dumps(r))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    plot(results, args.out / "speedup.png")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
