r"""`txl serve`'s engine without HTTP: a batched read step and a batched generation, per batch size.

Runs the engine's ``Model`` directly (no server): B sessions with memories of mem_len rows read one segment each as
one forward ('read'), or prefill their last segment and take ``--steps`` (B, 1) greedy generation steps on the kept
batch ('generate'), the host reading every token as the server does (this tree: drawn on the device, the next step's
input left there, one small copy a step, read after the next step is launched; an older engine: read before the next
step, or drawn on the host from the (V,) log-probs it copies back, as its server did); batch sizes are interleaved,
repeated, and the median tokens/s of each printed with its ratio to B = 1. ``--compile`` adds this tree's engine
with compiled generation steps (``txl.compiled_step``), interleaved with the others after an untimed round that
compiles. ``--captured`` adds the static-buffer decode step (``txl.captured_step``: captured as a CUDA graph per
batch bucket on CUDA, the same step uncaptured on a CPU), and with ``--compile`` that step compiled by inductor
before capture; ``--at-end`` also times this tree's generation with the host reading the tokens after the last step
(a request with no stop rule or stream: no wait for the device between steps). ``--profile`` prints torch.profiler's
top operators for one read and one generation at the largest B; ``--flops`` the FLOP rate of a read per batch size
against a large matmul's (whether batching can still pay).

``--shapes``: 'small' (4 layers, d_model 256, the character model of the serving tests) and/or 'wt103'
(transfo-xl-wt103's shape: 18 layers, d_model 1,024, 16 heads of 64, d_inner 4,096, the adaptive softmax with
cutoffs 20,000 / 40,000 / 200,000 and div_val 4 over 267,735 words; random weights; ``--wt103-mem-len`` rows of
memory per session, 1,600 as its evaluation reads).

    OMP_NUM_THREADS=1 python -m benchmarks.serve_step [--batch 1 8] [--repeats 5] [--threads 1] [--clock cpu]
                                              [--compile] [--captured] [--shapes small wt103] [--flops] [--profile]
    python -m benchmarks.serve_step --device cuda --batch 1 8 32     # on a GPU (the results come back to the host)

``--baseline DIR`` interleaves, in the same process, the engine and model of an older tree: DIR holds that
tree's ``src/txl`` copied as ``txl_old`` with its imports renamed, e.g. for commit C:

    git archive C src/txl | tar x -C DIR && mv DIR/src/txl DIR/txl_old
    grep -rl txl DIR/txl_old | xargs sed -i -E 's/^(\s*)import txl$/\1import txl_old as txl/;
        s/\bfrom txl\b/from txl_old/g; s/\bimport txl\b/import txl_old/g; s/"txl\./"txl_old./g;
        s/getLogger\("txl"\)/getLogger("txl_old")/g'
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.serve_common import make_model_dir


def baseline_model(package, directory: Path):
    """``package``'s model of ``directory`` (saved by this tree): an older tree that does not know this config's
    newer fields builds the model of the fields it knows (their defaults are the old behaviour) and loads the
    same weights."""
    import dataclasses

    import txl

    if package is txl:
        return txl.from_pretrained(directory)
    new = txl.from_pretrained(directory)
    known = {f.name for f in dataclasses.fields(package.ModelConfig)}
    model = package.TransformerXL(package.ModelConfig(**{k: v for k, v in dataclasses.asdict(new.config).items()
                                                         if k in known}))
    model.load_state_dict(new.state_dict())
    return model


WT103 = dict(vocab_size=267735, n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096,
             cutoffs=[20000, 40000, 200000], div_val=4, dropout=0.0)
"""transfo-xl-wt103's shape (configs/wt103_large.toml's model, without dropout)."""


def shape_models(shape: str, tmp: Path, trees: dict[str, str], device: str, wt103_mem_len: int) -> dict:
    """Each tree's model of ``shape``, the same weights: 'small' saved and loaded (an older tree reads the fields it
    knows), 'wt103' built at random (seeded) and its weights loaded into each tree's."""
    import importlib

    import txl

    if shape == "small":
        directory = make_model_dir(tmp / "model")
        return {name: baseline_model(importlib.import_module(package), directory).to(device)
                for name, package in trees.items()}
    torch.manual_seed(0)
    made = txl.TransformerXL(txl.ModelConfig(**WT103, mem_len=wt103_mem_len)).eval()
    models = {}
    for name, package in trees.items():
        pkg = importlib.import_module(package)
        model = made if pkg is txl else pkg.TransformerXL(pkg.ModelConfig(**WT103, mem_len=wt103_mem_len))
        if model is not made:
            model.load_state_dict(made.state_dict())
        models[name] = model.to(device)
    return models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--segment-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where the engine's model runs: cpu (default), cuda, cuda:N or "
                   "any torch device")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time (default); cpu: this process's CPU time (time.process_time), which on a "
                   "shared machine leaves out the time other processes held the core (on a GPU only 'wall' is fair)")
    p.add_argument("--compile", action="store_true", help="also run this tree's engine with compiled generation "
                   "steps (txl.compiled_step), interleaved with its eager engine; a first untimed round compiles")
    p.add_argument("--captured", action="store_true", help="also this tree's engine with the static-buffer decode "
                   "step (txl.captured_step; CUDA graphs on CUDA), and with --compile that step compiled")
    p.add_argument("--at-end", action="store_true", help="also this tree's generation with the host reading the "
                   "tokens after the last step (a request with no stop rule or stream), beside every step")
    p.add_argument("--shapes", nargs="+", choices=("small", "wt103"), default=["small"])
    p.add_argument("--wt103-mem-len", type=int, default=1600, help="the wt103 shape's memory rows per session")
    p.add_argument("--flops", action="store_true", help="also the FLOP of one read per batch size "
                   "(torch.utils.flop_counter) and the rate its median time makes, against one 1024^3 matmul's")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--baseline", default=None, help="a directory holding an older tree's txl as txl_old (above)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for shape in args.shapes:
        if len(args.shapes) > 1:
            print(f"-- {shape}")
        measure(args, shape)


def measure(args, shape: str) -> None:
    """The interleaved measurements of one model shape, printed."""
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    import importlib
    import importlib.util
    import sys

    trees = {"": "txl"}
    if args.baseline:
        if args.baseline not in sys.path:
            sys.path.insert(0, args.baseline)
        trees = {"old ": "txl_old", "new ": "txl"}
    S = args.segment_len
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        models = shape_models(shape, Path(tmp), trees, args.device, args.wt103_mem_len)
    engines, pipelined = {}, {}
    for name, package in trees.items():
        model = models[name]
        engine = importlib.import_module(f"{package}.serve.engine")
        picker = importlib.import_module(f"{package}.decoding").Picker
        # A tree whose server launches step t + 1 before reading step t's token (txl.serve.requests.Requests.pipelined)
        # is timed in that order; an older one reads each token first, as its server did.
        pipelined[name] = getattr(importlib.import_module(f"{package}.serve.requests").Requests, "pipelined", False) \
            if importlib.util.find_spec(f"{package}.serve.requests") else False
        ctx = dict(segment_len=S, mem_len=model.config.mem_len, same_length=False, clamp_len=0)
        graphs = {"graphs": "off"} if package == "txl" else {}  # the eager engine, whatever the device
        engines[name] = (engine.Model(model, **ctx, **graphs), engine.Unit, picker)
        for twin in ("compiled ", "captured ", "captured compiled "):
            pipelined[name + twin] = pipelined[name]
        if args.compile and package == "txl":
            engines[name + "compiled "] = (engine.Model(model, **ctx, compile=True, graphs="off"), engine.Unit, picker)
        if args.captured and package == "txl":
            engines[name + "captured "] = (engine.Model(model, **ctx, graphs="on"), engine.Unit, picker)
            if args.compile:
                engines[name + "captured compiled "] = (engine.Model(model, **ctx, graphs="on", compile=True),
                                                        engine.Unit, picker)
    trees = {name: None for name in engines}
    c = model.config
    L, d, V = c.n_layer, c.d_model, c.vocab_size

    def memory(m) -> torch.Tensor:
        # A session's memory lives where the model runs (the engine moves rows there; a session read back from
        # disk is on the CPU): made on the host, in the model's dtype, and moved, as a device keeps it.
        return torch.randn(L, m.mem_len, d, generator=g).to(device=args.device, dtype=m.dtype)

    def read(tree: str, B: int) -> int:
        m, Unit, _ = engines[tree]
        units = [Unit("score", torch.randint(0, V, (S,), generator=g).tolist(), memory(m),
                      torch.randint(0, V, (S,), generator=g).tolist()) for _ in range(B)]
        m.run("score", units)
        return B * S

    def generate(tree: str, B: int, at_end: bool = False) -> tuple[int, float]:
        # Prefill alone per session (their lengths differ in the server), then the steps batched, greedy; the host
        # reads every token (the server's stop rules and streaming need it; pipelined: each after the next step is
        # launched), or all after the last step (at_end).
        m, Unit, Picker = engines[tree]
        on_device = "pick" in Unit.__dataclass_fields__  # this tree: drawn on the device, the input left there
        pick = Picker(temperature=0.0, vocab_size=V, **({"device": m.device} if on_device else {}))
        drawn = {"pick": pick} if on_device else {}
        rows = [m.run("prefill", [Unit("prefill", torch.randint(0, V, (S,), generator=g).tolist(),
                                       memory(m), **drawn)])[0] for _ in range(B)]
        start = clock()
        pending = []
        for _ in range(args.steps):
            if on_device and at_end:
                pending.append([r.drawn for r in rows])
                rows = m.run("step", [Unit("step", [-1], row=r.row, pick=pick, after=r.drawn) for r in rows])
            elif on_device and pipelined[tree]:  # step t + 1 launched, then step t's tokens read
                after = m.run("step", [Unit("step", [-1], row=r.row, pick=pick, after=r.drawn) for r in rows])
                [r.drawn[0].get(r.drawn[1]) for r in rows]
                rows = after
            elif on_device:
                tokens = [r.drawn[0].get(r.drawn[1])[0] for r in rows]
                rows = m.run("step", [Unit("step", [t], row=r.row, pick=pick, after=r.drawn)
                                      for t, r in zip(tokens, rows)])
            else:  # an older engine: the (V,) log-probs on the host, drawn there, the token copied back in
                tokens = [int(pick(r.next_log_probs[None]).tokens[0]) for r in rows]
                rows = m.run("step", [Unit("step", [t], row=r.row) for t, r in zip(tokens, rows)])
        if on_device:
            for drawn in [*pending, [r.drawn for r in rows]]:  # the tokens reach the host: their time counts
                [d.get(b) for d, b in drawn]
        return B * args.steps, clock() - start

    if args.compile or args.captured:  # compiled graphs are made (CUDA graphs captured) on first use: not timed
        for B in args.batch:
            for tree in trees:
                generate(tree, B)
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.repeats):
        for B in args.batch:
            for tree in trees:
                if "compiled" not in tree and "captured" not in tree:  # those read as their eager twin does
                    start = clock()
                    n = read(tree, B)
                    times.setdefault((tree, "read", B), []).append(n / (clock() - start))
                n, seconds = generate(tree, B)
                times.setdefault((tree, "generate steps", B), []).append(n / seconds)
                if args.at_end and not tree.startswith("old"):  # an older engine reads every token
                    n, seconds = generate(tree, B, at_end=True)
                    times.setdefault((tree, "steps, read at end", B), []).append(n / seconds)
    for tree in trees:
        for what in ("read", "generate steps", "steps, read at end"):
            if (tree, what, args.batch[0]) not in times:
                continue
            one = statistics.median(times[(tree, what, args.batch[0])])
            for B in args.batch:
                rate = statistics.median(times[(tree, what, B)])
                print(f"{tree}{what:>18} B={B:>2}: {rate:9.0f} tokens/s ({rate / one:.2f}x B={args.batch[0]})")
    if args.flops:  # is a read compute-bound? its FLOP rate against the core's matmul rate
        from torch.utils.flop_counter import FlopCounterMode

        a = torch.randn(1024, 1024, device=args.device)
        a @ a
        start = clock()
        for _ in range(10):
            a @ a
        peak = 10 * 2 * 1024**3 / (clock() - start)
        print(f"a 1024^3 fp32 matmul: {peak / 1e9:.0f} GFLOP/s")
        for tree in trees:
            if "compiled" in tree or "captured" in tree:
                continue
            for B in args.batch:
                with FlopCounterMode(display=False) as counter:
                    read(tree, B)
                flop = counter.get_total_flops()
                rate = flop * statistics.median(times[(tree, "read", B)]) / (B * S)  # FLOP/s at the median time
                print(f"{tree}read B={B:>2}: {flop / 1e9:.2f} GFLOP, {rate / 1e9:.0f} GFLOP/s "
                      f"({rate / peak:.0%} of the matmul's)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        B = max(args.batch)
        for tree in trees:
            for what, fn in (("read", read), ("generate", generate)):
                cuda = [ProfilerActivity.CUDA] if torch.device(args.device).type == "cuda" else []
                with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
                    fn(tree, B)
                print(f"-- {tree}{what}, B={B}")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
