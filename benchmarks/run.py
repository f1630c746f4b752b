"""Throughput, memory, FLOPs, MFU and the evaluation speed-up over a vanilla Transformer, in one command.

    python -m benchmarks.run                        # small and base, fp32 and bf16, speed-up table, plot (CPU)
    python -m benchmarks.run --shapes small --dtypes fp32 --steps 5
    python -m benchmarks.run --compile both         # every phase eager and through torch.compile
    python -m benchmarks.run --device cuda          # base and NVIDIA's WikiText-103 base, bf16 and TF32,
                                                    # the speed-up at the paper's L = 800 .. 3800

This module is the driver (the phases and the tables); the FLOP model and the shapes are ``benchmarks.flops``,
the clocks, matmul peak, profiler and memory readings ``benchmarks.instruments``.

Run from the repository root (``benchmarks`` is a package beside ``src``; the library is the installed
``txl``, ``pip install -e .`` of this checkout). Every measured phase (train or eval, per shape, dtype and
compile setting; the speed-up sweep) runs in a fresh subprocess, so its peak memory is its own: the
resident set (ru_maxrss) on a CPU, ``torch.cuda.max_memory_allocated`` less the peak matmul's operands on
a GPU. Each subprocess also measures this machine's matmul peak (an n-cubed mm in the phase's dtype, n =
2048 on a CPU, 8192 on a GPU) before the first timed step and after every one, and MFU is the median over
steps of each step's achieved FLOP/s over the mean of the two peak samples around it: on a shared or
frequency-scaling machine the step and its peak are measured under the same conditions. On a GPU the
bf16 and TF32 peaks are both measured in every phase, and MFU against the bf16 peak is reported beside
the phase's own.

Training times the library's own step, ``txl.train.train_step`` (forward and backward under the run's
autocast, gradient scaler, clipped global norm, optimiser step, memory carried), with the trainer's
optimiser (``build_optimizer``). Evaluation carries the key/value cache as ``txl.evaluate`` does: the
memory rows' keys and values are those projected in the previous segment, not projected again.

Printed: a table per section, then one JSON line per measurement; results.jsonl and speedup.png are
written to --out.

FLOPs per token are counted analytically (no profiler): with N the non-embedding matmul parameters
(per layer q/k/v, output, and the two feed-forward matrices), S the output layer's matmul parameters a
token meets (the softmax; with an adaptive softmax the head for every token and each tail cluster for the
share of tokens that fall in it), L layers, H*D attention width and K = M + T keys per query,

    train = 6 (N + S) + 3 * 6 L (H D) K     eval = 2 (N + S) + 6 L (H D) K

where 6 L (H D) K is the forward cost of the three K-long attention products per query: the content
score (q + u) k^T, the positional score (q + v) R^T, and the weighted sum of values. The causal mask
is not subtracted (every score is computed). Work the implementation does on top of this -- in training
the keys and values of the memory rows and (with ``recompute_attention``) the attention scores recomputed in
backward; the W_kR
projection of R, the embedding -- is not counted, as MFU conventionally leaves out recomputation.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import txl
from benchmarks import sessions, switches
from benchmarks.flops import (  # noqa: F401 (Shape, SHAPES, ... are this driver's vocabulary: bench.SHAPES)
    NVIDIA_A100,
    SHAPES,
    Shape,
    attention_flops,
    flops_per_token,
    matmul_params,
    softmax_params,
    speedup_flop_ratio,
    token_probs,
)
from benchmarks.instruments import Bracket, MatmulPeak, Profile, device_name, make_clock, peak_rss_mb
from txl.cli.options import add_config_arguments, overrides_from, unknown_option_error
from txl.config import SECTIONS as ALL_SECTIONS
from txl.config import OptimConfig
from txl.data import Batch
from txl.distributed import DistInfo
from txl.evaluate import autocast
from txl.fileio import write_jsonl
from txl.model.memory import memory_length
from txl.optim import build_optimizer
from txl.presets import apply_overrides
from txl.runtime import compile_model, cpu_has_native_bf16, matmul_precision, retain_freed_memory, to_device
from txl.train import train_step as library_train_step

ROOT = Path(__file__).resolve().parents[1]


# Phase dtypes: fp32 is exact fp32 products; tf32 is fp32 with TF32 tensor-core matmuls (CUDA only); bf16
# and fp16 are autocast, fp16 with the gradient scaler (CUDA only).
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16"}  # the trainer's precision names
PHASES = ("train", "train-keep", "train-recompute", "eval")
MODES = {"eager": (), "compiled": ("--compiled",), "graphs": ("--graphed",), "step": ("--stepped",),
         "step-eager": ("--stepped", "--step-eager-kernels")}
"""How a phase runs. 'step' (training only): the whole step captured as one CUDA graph (``txl.step_graph``, what
``train.graphs`` 'auto' runs on CUDA), its model through inductor; 'step-eager': the same capture of eager kernels
(the A/B of the compilation inside the captured step)."""
"""How a phase runs: its worker's flags."""
GPU_SHAPES = ("base-gpu", "nvidia")
"""The CUDA default shapes: base at B 32, T = M = 512 (16,384 tokens a step), and NVIDIA's WikiText-103 base at
their own geometry (6,144 training tokens a step; evaluation B 32, T 64, M 640), which their published figures
are for. The CPU's base (1,024 tokens a step) leaves a GPU waiting on the host."""
DEFAULT_PHASES = ("train", "train-recompute", "eval")
# Dai et al. 2019, Table 9: evaluation speed-up over Al-Rfou et al. (2018) on a GPU, by attention length.
PAPER_SPEEDUP = {800: 363, 1800: 773, 2800: 1409, 3800: 1874}
CPU = torch.device("cpu")
SECTIONS = [s for s in ("model", "compute") if s in ALL_SECTIONS]
"""The config sections a benchmark's options set, for every shape (an earlier txl has no [compute])."""


def _fields(shape: Shape, changes: dict) -> tuple[dict, dict]:
    """The shape's model fields with its --model.FIELD / --compute.FIELD overrides, then the phase's own changes,
    split into ModelConfig's and ComputeConfig's. An earlier txl (``gpu_session --baseline-src``) has no
    ComputeConfig: its ModelConfig takes them all."""
    fields = dict(vocab_size=shape.vocab_size, n_layer=shape.n_layer, d_model=shape.d_model, n_head=shape.n_head,
                  d_head=shape.d_head, d_inner=shape.d_inner, mem_len=shape.mem_len, dropout=shape.dropout,
                  cutoffs=list(shape.cutoffs), div_val=shape.div_val)
    fields.update(shape.model)
    fields.update(changes)
    how = set(getattr(getattr(txl, "ComputeConfig", None), "__dataclass_fields__", ()))
    return {k: v for k, v in fields.items() if k not in how}, {k: v for k, v in fields.items() if k in how}


def model_config(shape: Shape, **changes) -> txl.ModelConfig:
    """What the shape's model is (``_fields``)."""
    return txl.ModelConfig(**_fields(shape, changes)[0])


def compute_config(shape: Shape, **changes) -> txl.ComputeConfig:
    """How the shape's model computes (``_fields``; this txl's)."""
    return txl.ComputeConfig(**_fields(shape, changes)[1])


def build_model(shape: Shape, **changes) -> txl.TransformerXL:
    """The shape's model, computed as its compute fields say (an earlier txl: all in its ModelConfig)."""
    what, how = _fields(shape, changes)
    return txl.TransformerXL(txl.ModelConfig(**what), *([txl.ComputeConfig(**how)] if how else []))


def batches(shape: Shape, n: int, generator: torch.Generator, device: torch.device | None = None):
    """n (input, label) segments of one token stream per batch row, in order, on ``device``.

    Tokens are uniform over the vocabulary, or Zipf-distributed for word-level shapes (``Shape.zipf``);
    they are drawn on the host and moved as the library's batch iterator moves them (``to_device``).
    """
    count = shape.batch * (n * shape.tgt_len + 1)
    if shape.zipf:
        flat = torch.multinomial(token_probs(shape).float(), count, replacement=True, generator=generator)
    else:
        flat = torch.randint(0, shape.vocab_size, (count,), generator=generator)
    stream = flat.view(shape.batch, n * shape.tgt_len + 1)  # (B, n T + 1)
    for s in range(n):
        lo = s * shape.tgt_len
        x = stream[:, lo:lo + shape.tgt_len].contiguous()  # (B, T)
        y = stream[:, lo + 1:lo + shape.tgt_len + 1].contiguous()  # (B, T)
        yield to_device(x, device), to_device(y, device)


def phase_context(device: torch.device, dtype_name: str) -> contextlib.AbstractContextManager:
    """TF32 matmuls on CUDA for the 'tf32' phases only, as ``train.tf32`` does for a run."""
    return matmul_precision(device, tf32=dtype_name == "tf32")


def library_step(step_model, optimizer, scaler, x, y, memories, precision: str, device: torch.device, start: int):
    """The trainer's own training step (``txl.train.train_step``) on one (B, T) batch; returns its memories."""
    batch = Batch(input_ids=x, labels=y, context_len=0, start=start)
    info = DistInfo(rank=0, world_size=1, device=device)
    step = getattr(step_model, "whole_step", library_train_step)  # the captured step takes train_step's place
    _, memories = step(step_model, optimizer, scaler, batch, memories, lr=2.5e-4, clip=0.25, precision=precision,
                       info=info)
    return memories


def same_batch_loss(model, x, y, memory, precision: str, seed: int) -> float:
    """Training-mode loss of one batch with a fixed dropout seed (no update)."""
    torch.manual_seed(seed)
    with torch.no_grad(), autocast(x.device, precision):
        return model(x, labels=y, memory=memory).loss.item()


def bf16_loss_check(model, x, y, memory) -> dict:
    """bf16 autocast against fp32 on the same batch, weights and dropout seed: both losses and their difference."""
    fp32 = same_batch_loss(model, x, y, memory, "fp32", seed=1)
    bf16 = same_batch_loss(model, x, y, memory, "bf16", seed=1)
    return dict(loss_fp32=fp32, loss_bf16=bf16, loss_diff=abs(bf16 - fp32))


def profiled(device: torch.device, step) -> dict:
    """One step under torch.profiler: its top operators and host / device time; a profiler that cannot trace the
    step (CUDA graphs are replayed, not launched op by op) loses the profile, not the row's measurements."""
    try:
        with Profile(device) as prof:
            step()
    except RuntimeError as err:
        return dict(profile_error=str(err)[-300:])
    return dict(profile=prof.table, profile_host_ms=prof.host_ms, profile_device_ms=prof.device_ms)


def worker_train(shape: Shape, dtype_name: str, warmup: int, steps: int, peak: MatmulPeak, *,
                 recompute: bool | None = None, compile: bool = False, graphs: bool = False,
                 graphs_backend: str | None = None, profile: bool = False, stepped: bool = False,
                 step_kernels: str = "compiled", device: torch.device = CPU) -> tuple[list[dict], dict]:
    """Timed training steps of the library's train_step (memory carried), peak samples around each; with
    ``profile``, one more step under torch.profiler (its top operators in ``extra['profile']``). ``recompute``:
    ``ComputeConfig.recompute_attention`` (None: the default, or ``--compute``'s). ``graphs``: the steps
    through ``txl.graphs.StaticSteps`` (static shapes, CUDA graphs), as ``train.graphs`` 'model' runs them;
    ``stepped``: the whole step captured (``txl.step_graph``, 'step'), its model compiled unless ``step_kernels`` is
    'eager'. ``extra['warmup_s']``: the untimed steps' wall time (compilation and capture), apart from the rows."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    changes = {} if recompute is None else dict(recompute_attention=recompute)
    model = build_model(shape, **changes).to(device).train()
    capturable = stepped and device.type == "cuda"
    # The trainer's (fused Adam); the keyword only when asked for: an earlier txl (--baseline-src) has none.
    optimizer = build_optimizer(model, OptimConfig(lr=2.5e-4), **({"capturable": True} if capturable else {}))
    precision = PRECISION[dtype_name]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    step_model = static_steps(model, graphs_backend) if graphs else compile_model(model, compile)
    if stepped:  # the trainer's captured step: train_step's arguments bound once
        step_model = step_graph(model, optimizer, scaler, graphs_backend, step_kernels, precision, device)
    if graphs or stepped:  # untimed: the compilation, then CUDA graphs' warm-up run and their recording
        warmup = max(warmup, GRAPHS_WARMUP + (stepped and 2))
    memories, samples, extra, bracket = [None], [], {}, Bracket(peak)
    started = time.perf_counter()
    for i, (x, y) in enumerate(batches(shape, warmup + steps + profile, gen, device)):
        if i == warmup and dtype_name == "bf16":
            extra = bf16_loss_check(model, x, y, memories[0])
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            warmup_s = time.perf_counter() - started
            bracket.start()
        if i == warmup + steps:  # the extra, profiled step
            extra.update(profiled(device, functools.partial(library_step, step_model, optimizer, scaler, x, y,
                                                            memories, precision, device, i * shape.tgt_len)))
            break
        t0 = peak.clock()
        memories = library_step(step_model, optimizer, scaler, x, y, memories, precision, device, i * shape.tgt_len)
        step = peak.clock() - t0
        if i >= warmup:
            samples.append(dict(step=step, peak=bracket.around()))
    extra.update(warmup_steps=warmup, warmup_s=warmup_s)
    return samples, extra


def step_graph(model, optimizer, scaler, backend: str | None, kernels: str, precision: str, device: torch.device):
    """``txl.step_graph.StepGraph`` called as ``train_step`` is (``library_step``), imported here: an earlier txl
    (``gpu_session --baseline-src``) has none."""
    from txl.step_graph import StepGraph

    info = DistInfo(rank=0, world_size=1, device=device)
    graph = StepGraph(model, optimizer, scaler, step=library_train_step, backend=backend,
                      compile=kernels == "compiled", clip=0.25,
                      precision=precision, info=info)

    def whole_step(model_, optimizer_, scaler_, batch, memories, *, lr, **_):
        return graph(batch, memories, lr=lr)

    graph.whole_step = whole_step
    return graph


def worker_eval(shape: Shape, dtype_name: str, warmup: int, steps: int, peak: MatmulPeak, *,
                compile: bool = False, graphs: bool = False, graphs_backend: str | None = None,
                profile: bool = False, device: torch.device = CPU) -> tuple[list[dict], dict]:
    """Timed evaluation segments (per-token NLL, memory and key/value cache carried), peak samples around each.

    As ``txl.evaluate``: the memory rows' keys and values come from the previous segment's cache instead of
    being projected again (the weights do not change in evaluation). The warm-up lasts at least until the
    memory is full, and every timed segment is checked to read M = mem_len rows. ``graphs``: as ``txl.evaluate``
    runs them, over key/value rings captured as one CUDA graph (``txl.static_eval``), or, for a model the rings
    cannot read (or an earlier txl without them), through ``txl.graphs.StaticSteps`` (``extra['rings']`` says which).
    """
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build_model(shape).to(device).eval()
    ring = static_eval(model, graphs_backend) if graphs else None
    forward = static_steps(model, graphs_backend) if graphs and ring is None else compile_model(model, compile)
    memory, cache, samples, bracket = None, model.start_kv_cache(), [], Bracket(peak)
    extra = {"rings": ring is not None} if graphs else {}
    # Untimed until the memory is full and one more segment has run at its final shape: a timed segment reads
    # M = mem_len rows, as a long evaluation does, at a shape its kernels (and compiled graphs) have met; the rings
    # also until their segment is captured.
    warmup = max(warmup, eval_fill_segments(shape) + 1, ring.warmup + 1 if ring is not None and ring.capture else 0)

    def segment(x, y):
        with torch.inference_mode(), autocast(device, PRECISION[dtype_name]):
            if ring is not None:
                ring(x, y).sum().item()
                return ring  # its buffers hold what the next segment reads
            out = forward(x, labels=y, memory=memory, kv_cache=cache)
        out.nll.sum().item()
        return out

    def memory_rows() -> int:
        return memory_length(memory) if ring is None else int(ring.buffers["filled"])

    started = time.perf_counter()
    for i, (x, y) in enumerate(batches(shape, warmup + steps + profile, gen, device)):
        if i == warmup:
            warmup_s = time.perf_counter() - started  # each segment reads its loss back: nothing left queued
            bracket.start()
        if i >= warmup and memory_rows() != shape.mem_len:
            raise AssertionError(f"timed segment {i - warmup} read {memory_rows()} memory rows, not the "
                                 f"evaluation's mem_len {shape.mem_len}")
        if i == warmup + steps:  # the extra, profiled segment
            extra.update(profiled(device, functools.partial(segment, x, y)))
            break
        t0 = peak.clock()
        out = segment(x, y)
        step = peak.clock() - t0
        if i >= warmup:
            samples.append(dict(step=step, peak=bracket.around()))
        if ring is None:
            memory, cache = out.memory, out.kv_cache
    extra.update(warmup=warmup, warmup_steps=warmup, warmup_s=warmup_s, timed_mem_len=shape.mem_len)
    return samples, extra


GRAPHS_WARMUP = 3
"""Training steps the graphs mode leaves untimed at least: torch.compile's, and cudagraph trees' warm-up run and
recording (the replays come after)."""


def static_eval(model: txl.TransformerXL, backend: str | None):
    """``txl.static_eval.StaticEval`` over the model's own context, as ``txl.evaluate(graphs=True)`` makes it; None
    where the rings do not apply, or in an earlier txl (``gpu_session --baseline-src``), which has none."""
    try:
        from txl.static_eval import StaticEval, static_eval_error
    except ImportError:
        return None
    context = model.config.context()
    return None if static_eval_error(model, context) else StaticEval(model, context, backend=backend)


def static_steps(model: txl.TransformerXL, backend: str | None):
    """``txl.graphs.StaticSteps(model)``, imported here: a run against an earlier txl (``gpu_session
    --baseline-src``), which has no txl.graphs, still runs its eager and compiled phases."""
    from txl.graphs import StaticSteps

    return StaticSteps(model, backend=backend)


def eval_fill_segments(shape: Shape) -> int:
    """Segments an evaluation reads before its memory holds mem_len rows (the shape's evaluation one)."""
    return -(-shape.mem_len // shape.tgt_len)


ORIGINAL_EVAL_TGT_LEN = 128
"""The original's evaluation geometry (Dai et al.'s scripts, e.g. enwik8 large: tgt_len 128, mem_len 3800):
short segments against a long memory, beside T = M = L."""
SPEEDUP_WARMUP = 2
"""Untimed repetitions of every shape of one length before its timed ones (allocator, kernels, caches)."""


def spread(times: list[float]) -> float:
    """(max - min) / median of repeated timings: how far one repetition strays."""
    return (max(times) - min(times)) / statistics.median(times)


@torch.inference_mode()
def worker_speedup(shape: Shape, lengths: list[int], reps: int,
                   device: torch.device = CPU) -> list[dict]:
    """Per-token evaluation time: Transformer-XL against a vanilla model slid over L-token windows.

    The vanilla model is Al-Rfou et al.'s: learned absolute positions added at every layer, no memory;
    each window of L tokens predicts only its last token, so only that position goes through the softmax.
    Transformer-XL reads segments against a full memory of M = L cached states (keys and values carried, as
    ``txl.evaluate``), in two geometries: T = M = L, and the original's T = 128 (short segments, long memory).
    Batch 1, fp32. Each length warms every shape up (``SPEEDUP_WARMUP`` repetitions) and then times ``reps``
    repetitions of the three in turn, so all see the same machine; medians are reported with their spread.
    """
    rows = []
    gen = torch.Generator().manual_seed(0)
    clock = make_clock(device)
    for length in lengths:
        torch.manual_seed(0)
        xl = build_model(shape, mem_len=length, dropout=0.0).to(device).eval()
        vanilla = build_model(shape, mem_len=0, dropout=0.0, attn_type="al_rfou",
                              learned_positions=length).to(device).eval()
        short = min(ORIGINAL_EVAL_TGT_LEN, length)
        n = SPEEDUP_WARMUP + reps
        tokens = torch.randint(0, shape.vocab_size, (1, (n + 2) * length + n * short + 1), generator=gen).to(device)
        first = xl(tokens[:, :length], kv_cache=txl.KVCache())  # a full memory (and its keys) from here on
        seg = {"xl": length, "xl_short": short}  # each geometry's segment length
        state = {name: (first.memory, first.kv_cache) for name in seg}
        at = {"xl": length, "xl_short": (n + 1) * length}  # where each geometry reads its next segment

        def read(name: str, xl=xl, tokens=tokens, seg=seg, state=state, at=at, length=length) -> None:
            """One XL segment of geometry ``name`` against its full memory, carried on."""
            memory, cache = state[name]
            assert memory[0].size(1) == length, "every XL segment runs against a full memory of M = L"
            T = seg[name]
            out = xl(tokens[:, at[name]:at[name] + T], memory=memory, kv_cache=cache, return_log_probs=True)
            state[name], at[name] = (out.memory, out.kv_cache), at[name] + T

        times: dict[str, list[float]] = {"xl": [], "xl_short": [], "vanilla": []}
        for r in range(n):
            t0 = clock()
            read("xl")
            t1 = clock()
            read("xl_short")
            t2 = clock()
            window = tokens[:, r + 1:r + 1 + length]  # slid by one token
            last = vanilla(window, return_log_probs=False).hidden[:, -1]  # (1, d): the one position it predicts
            vanilla.softmax.log_prob(last)
            t3 = clock()
            if r >= SPEEDUP_WARMUP:
                times["xl"].append((t1 - t0) / length)
                times["xl_short"].append((t2 - t1) / short)
                times["vanilla"].append(t3 - t2)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(length=length, xl_ms_per_token=1e3 * med["xl"], vanilla_ms_per_token=1e3 * med["vanilla"],
                         speedup=med["vanilla"] / med["xl"], flop_ratio=speedup_flop_ratio(shape, length),
                         paper=PAPER_SPEEDUP.get(length), short_tgt_len=short,
                         xl_short_ms_per_token=1e3 * med["xl_short"], speedup_short=med["vanilla"] / med["xl_short"],
                         flop_ratio_short=speedup_flop_ratio(shape, length, short), reps=reps,
                         spread={k: spread(v) for k, v in times.items()}))
    return rows


def speedup_regime(shape: Shape, shape_name: str, reps: int, device: torch.device) -> str:
    """What a speed-up table measured, in one line: the model, batch, geometry, precision, repetitions, spread."""
    return (f"{shape_name} widths ({shape.n_layer} layers, d_model {shape.d_model}, {shape.n_head} heads of "
            f"{shape.d_head}, vocabulary {shape.vocab_size}), batch 1, fp32, on {device_name(device)}; "
            f"Transformer-XL: T = M = L, and T = {ORIGINAL_EVAL_TGT_LEN} (L if shorter), M = L (the original's "
            "evaluation geometry), keys and values cached; vanilla: an L-token window per predicted token, its last "
            f"position scored; every length warmed up ({SPEEDUP_WARMUP} repetitions), then {reps} timed in turn, "
            "medians; spread = (max - min) / median of the repetitions")


def worker_bf16_check(shape: Shape) -> dict:
    """On a CPU without bf16 matrix instructions: the bf16-vs-fp32 loss check alone, and the two mm speeds.

    The loss check runs the same batch (after one segment of memory) in fp32 and under bf16 autocast; no
    phase is timed, since bf16 matmuls run through scalar or conversion paths there.
    """
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build_model(shape).train()
    (x0, y0), (x, y) = batches(shape, 2, gen)
    with torch.no_grad():
        memory = model(x0, labels=y0).memory
    t0 = time.perf_counter()
    check = bf16_loss_check(model, x, y, memory)
    check_s = time.perf_counter() - t0
    speeds = {f"mm_flops_{name}": MatmulPeak(DTYPES[name], n=512).sample() for name in ("fp32", "bf16")}
    return dict(check, check_s=check_s, **speeds)


def device_peaks(device: torch.device, clock) -> dict:
    """On a GPU: the bf16 and the TF32 matmul peaks of this device, measured now (FLOP/s)."""
    if device.type != "cuda":
        return {}
    bf16 = MatmulPeak(torch.bfloat16, clock, device=device)
    bf16_flops = max(bf16.sample() for _ in range(3))
    del bf16
    with matmul_precision(device, tf32=True):
        tf32 = MatmulPeak(torch.float32, clock, device=device)
        tf32_flops = max(tf32.sample() for _ in range(3))
    del tf32
    return dict(peak_bf16_flops=bf16_flops, peak_tf32_flops=tf32_flops)


def run_worker(args) -> None:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as the txl command does
    given = apply_overrides({}, overrides_from(args))
    model_fields = {**switches.model_fields(args.before), **given.get("model", {}), **given.get("compute", {})}
    shape = SHAPES[args.shape].resized(batch=args.batch, tgt_len=args.tgt_len, mem_len=args.mem_len)
    shape = shape.with_model(model_fields)
    common = dict(shape=args.shape, threads=args.threads, device=str(device), device_name=device_name(device),
                  txl_from=str(Path(txl.__file__).parent), **({"model": model_fields} if model_fields else {}))
    if args.worker == "bf16check":
        print(json.dumps(dict(kind="bf16check", **common, **worker_bf16_check(shape))))
        return
    if args.worker == "speedup":
        rows = worker_speedup(shape, args.lengths, args.reps, device)
        print(json.dumps(dict(kind="speedup", **common, rows=rows, peak_rss_mb=peak_rss_mb(),
                              regime=speedup_regime(shape, args.shape, args.reps, device))))
        return
    clock = time.process_time if args.clock == "cpu" else make_clock(device)
    peaks = device_peaks(device, clock)
    with phase_context(device, args.dtype), switches.before(args.before):
        peak = MatmulPeak(DTYPES[args.dtype], clock, device=device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        if args.worker == "eval":
            samples, extra = worker_eval(shape.for_phase("eval"), args.dtype, args.warmup, args.steps, peak,
                                         compile=args.compiled, graphs=args.graphed,
                                         graphs_backend=args.graphs_backend, profile=args.profile, device=device)
        else:  # 'train': the model's default; 'train-keep' keeps the attention probabilities, 'train-recompute' not
            recompute = {"train": None, "train-keep": False, "train-recompute": True}[args.worker]
            samples, extra = worker_train(shape, args.dtype, args.warmup, args.steps, peak,
                                          recompute=recompute, compile=args.compiled, graphs=args.graphed,
                                          graphs_backend=args.graphs_backend, profile=args.profile,
                                          stepped=args.stepped,
                                          step_kernels="eager" if args.step_eager_kernels else "compiled",
                                          device=device)
        wall = time.perf_counter() - t0
    run_shape = shape.for_phase(args.worker)
    tokens = run_shape.batch * run_shape.tgt_len
    fpt = flops_per_token(shape, args.worker)
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    mfu = statistics.median(fpt * tokens / s["step"] / s["peak"] for s in samples)  # each step by the peaks around it
    record = dict(kind=args.worker, **common, dtype=args.dtype, compile=args.compiled, graphs=args.graphed,
                  **({"captured": "eager kernels" if args.step_eager_kernels else "compiled"}
                     if args.stepped else {}),
                  before=args.before, clock=args.clock,
                  steps=len(samples), batch=run_shape.batch, tgt_len=run_shape.tgt_len, mem_len=run_shape.mem_len,
                  tokens_per_step=tokens, tokens_per_s=tokens / med["step"], flops_per_token=fpt,
                  achieved_flops=fpt * tokens / med["step"], peak_flops=med["peak"], mfu=mfu,
                  peak_rss_mb=peak_rss_mb(), phase_wall_s=wall, step_s=med["step"], **peaks, **extra)
    if device.type == "cuda":
        record["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - peak.nbytes) / 2**20
        record["mfu_vs_bf16_peak"] = record["achieved_flops"] / peaks["peak_bf16_flops"]
    print(json.dumps(record))


# -- driver --------------------------------------------------------------------------------------------
def spawn(args, *extra: str) -> list[dict]:
    resize = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("batch", "tgt_len", "mem_len")
              if getattr(args, name)]
    model = [f"--{key}={value}" for key, value in overrides_from(args).items()]
    backend = ["--graphs-backend", args.graphs_backend] if args.graphs_backend else []
    cmd = [sys.executable, "-m", "benchmarks.run", "--threads", str(args.threads), "--device", args.device, *resize,
           *model, *backend, *extra]
    # A session of its own: a timeout (or Ctrl-C here) ends the worker with whatever it started (torch.compile's
    # compile workers).
    proc, stdout, stderr, timed_out = sessions.run(cmd, args.worker_timeout, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True, cwd=ROOT)
    failure = f"over --worker-timeout {args.worker_timeout:g} s" if timed_out else \
        (f"exit status {proc.returncode}" if proc.returncode else None)
    if failure is None:
        return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    sys.stderr.write(stderr)
    if not args.keep_going:
        raise SystemExit(f"benchmark worker failed ({failure}): {' '.join(cmd)}")
    # --keep-going: the failure is a row of its own (what ran, why it stopped, the error's last line), so a
    # time-limited session keeps the measurements before and after it.
    def value(flag: str) -> str | None:
        return extra[extra.index(flag) + 1] if flag in extra else None

    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    return [dict(kind="failed", phase=value("--worker"), shape=value("--shape"), dtype=value("--dtype"),
                 compile="--compiled" in extra, graphs="--graphed" in extra, model=overrides_from(args),
                 failure=failure, error=last[-500:],
                 command=" ".join(cmd[1:]))]


def spawn_repeated(args, *extra: str) -> list[dict]:
    """``args.repeats`` fresh runs of one phase; the run with the median MFU stands for them, with every run's
    MFU, tokens/s and peak memory attached (a noisy machine moves single runs by 10% and more)."""
    runs = [r for _ in range(args.repeats) for r in spawn(args, *extra)]
    if len(runs) == 1 or any(r["kind"] == "failed" for r in runs):
        return runs
    median = sorted(runs, key=lambda r: r["mfu"])[len(runs) // 2]
    spread = {f"{k}_runs": [r[k] for r in runs] for k in ("mfu", "tokens_per_s", "peak_rss_mb")}
    return [dict(median, repeats=len(runs), **spread)]


def mode_of(r: dict) -> str:
    """How a row's phase ran: 'step' or 'step-eager' (txl.step_graph), 'graphs' (txl.graphs), 'compiled'
    (torch.compile) or 'eager'."""
    if r.get("captured"):
        return "step" if r["captured"] == "compiled" else "step-eager"
    return "graphs" if r.get("graphs") else ("compiled" if r.get("compile") else "eager")


def memory_mb(r: dict) -> float:
    """A phase's peak memory: allocated on the GPU, resident on the CPU."""
    return r.get("peak_mem_mb", r["peak_rss_mb"])


def print_tables(results: list[dict]) -> None:
    runs = [r for r in results if r["kind"] in PHASES]
    for name in sorted({r["device_name"] for r in results if "device_name" in r}):
        print(f"device: {name}")
    if runs:
        mem = "GPU MB" if any("peak_mem_mb" in r for r in runs) else "RSS MB"
        head = (f"{'shape':<8} {'dtype':<5} {'mode':<8} {'phase':<10} {'B':>3} {'T':>4} {'M':>4} {'tok/s':>9} "
                f"{'step ms':>8} {'MFLOP/tok':>9} {'GFLOP/s':>8} {'peak':>6} {'MFU':>5} {mem:>7}")
        print(head)
        print("-" * len(head))
        for r in runs:
            print(f"{r['shape']:<8} {r['dtype']:<5} {mode_of(r):<8} {r['kind']:<10} "
                  f"{r.get('batch', ''):>3} {r.get('tgt_len', ''):>4} {r.get('mem_len', ''):>4} "
                  f"{r['tokens_per_s']:>9.0f} {1e3 * r['step_s']:>8.1f} {r['flops_per_token'] / 1e6:>9.1f} "
                  f"{r['achieved_flops'] / 1e9:>8.1f} {r['peak_flops'] / 1e9:>6.0f} {r['mfu']:>5.2f} "
                  f"{memory_mb(r):>7.0f}" + (f"  before: {', '.join(r['before'])}" if r.get("before") else ""))
        for r in runs:
            if "mfu_vs_bf16_peak" in r:
                print(f"{r['shape']} {r['dtype']} {r['kind']}: MFU {r['mfu_vs_bf16_peak']:.3f} of the bf16 peak "
                      f"({r['peak_bf16_flops'] / 1e12:.0f} TFLOP/s), {r['achieved_flops'] / r['peak_tf32_flops']:.3f}"
                      f" of the TF32 peak ({r['peak_tf32_flops'] / 1e12:.0f} TFLOP/s) measured in the same run")
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
        by = {(r["shape"], r["dtype"], r["kind"], mode_of(r), tuple(r.get("before", ()))): r for r in runs}
        for (shape, dtype, kind, mode, before), r in by.items():
            eager = by.get((shape, dtype, kind, "eager", before))
            if mode != "eager" and eager:
                print(f"{shape} {dtype} {kind}: {mode} / eager tokens/s = "
                      f"{r['tokens_per_s'] / eager['tokens_per_s']:.2f}x (MFU {eager['mfu']:.2f} -> {r['mfu']:.2f})")
            if mode == "eager" and dtype == "bf16" and (shape, "fp32", kind, mode, before) in by:
                print(f"{shape} {kind}: bf16 autocast / fp32 tokens/s = "
                      f"{r['tokens_per_s'] / by[shape, 'fp32', kind, mode, before]['tokens_per_s']:.2f}x")
            if before and (shape, dtype, kind, mode, ()) in by:
                print(f"{shape} {dtype} {kind} {mode}: with / without {', '.join(before)} tokens/s = "
                      f"{by[shape, dtype, kind, mode, ()]['tokens_per_s'] / r['tokens_per_s']:.2f}x")
        for r in runs:
            if r["shape"] == "nvidia":
                paper = NVIDIA_A100["train"] if r["kind"].startswith("train") else NVIDIA_A100["eval"]
                script = "" if r["kind"].startswith("train") else \
                    f", {NVIDIA_A100['eval_torchscript']:,} TorchScript"
                print(f"nvidia {r['dtype']} {r['kind']} (B {r['batch']}, T {r['tgt_len']}, M {r['mem_len']}): "
                      f"{r['tokens_per_s']:,.0f} tok/s on {r['device_name']}; NVIDIA's A100 AMP figure at batch 32: "
                      f"{paper:,} tok/s{script}")
    for r in (r for r in runs if "profile" in r):
        how = "" if mode_of(r) == "eager" else f" ({mode_of(r)})"
        print(f"\nprofile of one {r['shape']} {r['dtype']} {r['kind']} step{how}:")
        print(r["profile"])
    for r in (r for r in results if r["kind"] == "bf16check"):
        print(f"{r['shape']} bf16: not timed, this CPU has no bf16 matrix instructions (AVX512_BF16 or AMX): a "
              f"512-cubed mm runs at {r['mm_flops_bf16'] / 1e9:.1f} GFLOP/s in bf16 against "
              f"{r['mm_flops_fp32'] / 1e9:.0f} in fp32 (--force-bf16 times it anyway). Same batch: bf16 autocast "
              f"loss {r['loss_bf16']:.5f} vs fp32 {r['loss_fp32']:.5f}, |diff| = {r['loss_diff']:.2e}")
    for r in (r for r in results if r["kind"] == "speedup"):
        print("\nevaluation speed-up over a vanilla Transformer slid one token at a time: "
              + r.get("regime", f"{r['shape']} widths, batch 1, fp32, XL with T = M = L, {r.get('device', 'cpu')}"))
        head = (f"{'L':>5} {'XL ms/tok':>10} {'vanilla ms/tok':>15} {'speed-up':>9} {'FLOP ratio':>11} "
                f"{'T=128 ms/tok':>13} {'speed-up':>9} {'spread XL/short/van':>20} {'paper (GPU)':>12}")
        print(head)
        print("-" * len(head))
        for row in r["rows"]:
            paper = f"{row['paper']}x" if row["paper"] else ""
            sp = row.get("spread", {})
            spreads = "/".join(f"{100 * sp[k]:.0f}%" for k in ("xl", "xl_short", "vanilla") if k in sp)
            print(f"{row['length']:>5} {row['xl_ms_per_token']:>10.3f} {row['vanilla_ms_per_token']:>15.2f} "
                  f"{row['speedup']:>8.0f}x {row['flop_ratio']:>10.0f}x {row.get('xl_short_ms_per_token', 0):>13.3f} "
                  f"{row.get('speedup_short', 0):>8.0f}x {spreads:>20} {paper:>12}")
        print("paper, Table 9: " + ", ".join(f"{v}x at {k}" for k, v in PAPER_SPEEDUP.items()))
    for r in (r for r in results if r["kind"] == "failed"):
        how = "" if mode_of(r) == "eager" else f" {mode_of(r)}"
        what = " ".join(str(v) for v in (r["shape"], r["dtype"], r["phase"]) if v)
        print(f"FAILED {what}{how} ({r['failure']}): {r['error']}")


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
        where = "GPU" if r.get("device", "cpu").startswith("cuda") else "CPU"
        ax1.plot(lengths, [row["speedup"] for row in r["rows"]], "o-", label=f"measured, {where} ({r['shape']})")
        ax1.plot(lengths, [row["flop_ratio"] for row in r["rows"]], "s--", label="FLOP ratio")
    ax1.plot(list(PAPER_SPEEDUP), list(PAPER_SPEEDUP.values()), "^:", label="paper, Table 9 (GPU)")
    ax1.set(xscale="log", yscale="log", xlabel="attention length L", ylabel="speed-up over vanilla",
            title="Evaluation speed-up")
    ticks = sorted({row["length"] for r in results if r["kind"] == "speedup" for row in r["rows"]} | set(PAPER_SPEEDUP))
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax1.legend()
    runs = [r for r in results if r["kind"] in PHASES]
    labels = [f"{r['shape']}\n{r['dtype']} {r['kind']}{'' if mode_of(r) == 'eager' else ' ' + mode_of(r)}"
              for r in runs]
    ax2.bar(range(len(runs)), [r["mfu"] for r in runs])
    ax2.set_xticks(range(len(runs)), labels, fontsize=7)
    ax2.set(ylabel="MFU (of the same-dtype matmul peak)", title="Model FLOP utilisation", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def check_device(name: str) -> torch.device:
    """The --device argument as a torch device; one clear line when CUDA is asked for and missing."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine; run with --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise SystemExit(f"--device {name}: choose cpu, cuda or cuda:N")
    return torch.device(name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                   help="default: small and base on a CPU; base and nvidia on a GPU")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                   help="default: fp32 and bf16 on a CPU; bf16 and tf32 on a GPU (fp16: autocast with the "
                        "gradient scaler, GPU only)")
    p.add_argument("--phases", nargs="+", default=list(DEFAULT_PHASES), choices=list(PHASES),
                   help="train: the model as configured (the default keeps the attention probabilities); "
                        "train-recompute / train-keep: recompute_attention=True / False; eval: evaluation")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off",
                   help="run the phases through torch.compile (on), eagerly (off) or both, side by side")
    p.add_argument("--modes", nargs="+", choices=list(MODES),
                   help="how the phases run, side by side: eager, compiled (torch.compile), graphs (txl.graphs: "
                        "static shapes, CUDA graphs on a GPU), step and step-eager (training: the whole step "
                        "captured, txl.step_graph, its model compiled or not); default: as --compile says")
    p.add_argument("--before", nargs="*", default=[], choices=list(switches.SWITCHES), metavar="CHANGE",
                   help="run with these changes of issue 34 switched back to before them (benchmarks.switches; "
                        f"{', '.join(switches.SWITCHES)}): one side of an A/B")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, one more under torch.profiler: its top operators are printed")
    p.add_argument("--batch", type=int, help="override every shape's batch (train and eval)")
    p.add_argument("--tgt-len", type=int, help="override every shape's segment length (train and eval)")
    p.add_argument("--mem-len", type=int, help="override every shape's memory length (train and eval)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--steps", type=int, default=7, help="timed steps; medians are reported")
    p.add_argument("--repeats", type=int, default=1,
                   help="fresh runs of each train/eval phase; the median-MFU run is reported with the spread")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: time by process CPU time, steadier on a shared machine; use with --threads 1")
    p.add_argument("--lengths", nargs="*", type=int,
                   help="attention lengths of the speed-up sweep (none: skip it); default 128 .. 1600 on a CPU, "
                        "the paper's 800 1800 2800 3800 on a GPU")
    p.add_argument("--speedup-shape", default="small", choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per length of the speed-up sweep "
                   "(after its warm-up; default 10)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                   help="results.jsonl (rewritten after every measurement) and speedup.png go here")
    p.add_argument("--keep-going", action="store_true",
                   help="a worker that fails or runs out of time is a 'failed' row; the others still run")
    p.add_argument("--worker-timeout", type=float, default=None,
                   help="seconds one measurement (a fresh subprocess) may take; default: no limit")
    p.add_argument("--force-bf16", action="store_true",
                   help="time the bf16 phases even on a CPU without bf16 matrix instructions (very slow there)")
    add_config_arguments(p, SECTIONS)  # e.g. --model.dropout 0, --compute.attn_impl reference
    p.add_argument("--worker", choices=[*PHASES, "speedup", "bf16check"], help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)  # a worker's compile setting
    p.add_argument("--graphed", action="store_true", help=argparse.SUPPRESS)  # a worker's graphs setting
    p.add_argument("--stepped", action="store_true", help=argparse.SUPPRESS)  # a worker's captured step
    p.add_argument("--step-eager-kernels", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--graphs-backend", help="torch.compile's backend in the graphs mode (default: inductor, CUDA "
                                           "graphs on a GPU; aot_eager: a CPU smoke run without code generation)")
    args, extra = p.parse_known_args(argv)
    try:  # a misspelt --model.FIELD or a bad value: one line naming it, before any work
        if extra:
            raise unknown_option_error(extra, SECTIONS, p.prog)
        apply_overrides({}, overrides_from(args))
    except ValueError as err:
        p.error(str(err))
    for flag, value, least in (("--steps", args.steps, 1), ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0),
                               ("--reps", args.reps, 1)):
        if value < least:
            p.error(f"{flag} {value}: give at least {least}")
    if args.worker_timeout is not None and args.worker_timeout <= 0:
        p.error(f"--worker-timeout {args.worker_timeout:g}: give a positive number of seconds")
    switches.model_fields(args.before)  # a switch this txl lacks: one line, before any work
    if args.worker:
        return run_worker(args)
    device = check_device(args.device)
    gpu = device.type == "cuda"
    shapes = args.shapes or (list(GPU_SHAPES) if gpu else ["small", "base"])
    dtypes = list(args.dtypes or (["bf16", "tf32"] if gpu else ["fp32", "bf16"]))
    lengths = args.lengths if args.lengths is not None else \
        (list(PAPER_SPEEDUP) if gpu else [128, 256, 512, 800, 1600])
    for name in ("tf32", "fp16"):
        if name in dtypes and not gpu:
            raise SystemExit(f"--dtypes {name}: {name} needs --device cuda; use fp32 or bf16 on a CPU")
    modes = args.modes or {"off": ["eager"], "on": ["compiled"], "both": ["eager", "compiled"]}[args.compile]
    sessions.exit_on_sigterm()  # a running worker's session is stopped too

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []

    def record(rows: list[dict]) -> None:  # written out whole after every measurement: a time limit keeps them
        results.extend(rows)
        write_jsonl(args.out / "results.jsonl", results)

    common = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--clock", args.clock,
              *(["--profile"] if args.profile else [])]
    if "bf16" in dtypes and not gpu and not args.force_bf16 and cpu_has_native_bf16() is False:
        # bf16 matmuls without AVX512_BF16/AMX run through scalar or conversion paths, ~100x slower than fp32:
        # timing them says nothing about this implementation. The loss check is still made.
        dtypes.remove("bf16")
        for shape in shapes:
            record(spawn(args, "--worker", "bf16check", "--shape", shape))
    for shape in shapes:
        for dtype in dtypes:
            for phase in args.phases:
                for mode in modes:
                    if mode.startswith("step") and phase == "eval":  # a training step; evaluation has no optimiser
                        continue
                    record(spawn_repeated(args, "--worker", phase, "--shape", shape, "--dtype", dtype, *common,
                                          *MODES[mode], *(["--before", *args.before] if args.before else [])))
    if lengths:
        record(spawn(args, "--worker", "speedup", "--shape", args.speedup_shape, "--reps", str(args.reps),
                     "--lengths", *map(str, lengths)))
    print_tables(results)
    print()
    for r in results:
        print(json.dumps(r))
    plot(results, args.out / "speedup.png")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
