"""Side by side with the oracle: txl against Hugging Face ``transformers`` 4.37.2 ``TransfoXLLMHeadModel``.

    python -m benchmarks.oracle                                  # small and base, train and eval, fp32
    python -m benchmarks.oracle --shapes small --dtypes fp32,bf16 --steps 12 --threads 2
    python -m benchmarks.oracle --profile small:eval             # torch.profiler's top operators of each model

The oracle computes the attention the way the original PyTorch code does (einsum scores, the pad-and-view
shift), so it stands in for "the original implementation". Both models get the same weights (txl's exported
to the Hugging Face layout), the same batches and the same memory length, and their steps alternate in one
process (txl, oracle, txl, oracle, ...): on a shared, noisy machine both see the same conditions, and the
ratio of their median step times is what is reported, with the load average before and after. Each step's
process CPU time is reported too (``cpu_speedup``): with ``--threads 1`` it counts the work a step does whatever
else runs on the machine (waiting for a busy core is not counted), so on a shared machine it is the steadier
ratio; with more threads it also counts the threads' spin-waits.

Training: forward, backward and an Adam step on one segment, memory carried (each model's own), dropout as
configured (the oracle's ``nn.Dropout``; txl's default ``dropout_impl='fast'``, its gap sampler on the CPU, the same
distribution). Evaluation: ``torch.no_grad()``
forward with labels and memory; txl carries its key/value cache as ``txl.evaluate`` does, the oracle its mems.
bf16 is ``torch.autocast`` around txl's step (worth timing only where the CPU has AVX512_BF16 or AMX); the
oracle fails under it (its adaptive softmax writes bf16 rows into a float32 tensor), so it runs in fp32.

Needs ``transformers==4.37.2`` (the ``oracle`` extra, in an environment of its own: it pins old libraries).
Prints one table and one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

import txl
from benchmarks.flops import SHAPES, Shape
from benchmarks.instruments import Profile, cpu_model
from benchmarks.run import build_model
from txl.convert.hf import config_to_hf, state_dict_to_hf
from txl.runtime import retain_freed_memory

DTYPES = ("fp32", "bf16")


def build_pair(shape: Shape, seed: int = 0, **changes) -> tuple[txl.TransformerXL, torch.nn.Module]:
    """txl's model (its defaults: the fused kernels, ``nn.Dropout``) and the oracle with the same weights."""
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(seed)
    ours = build_model(shape, dropatt=0.0, **changes)  # ComputeConfig fields among the changes go to its own config
    config = ours.config
    oracle = TransfoXLLMHeadModel(TransfoXLConfig(**config_to_hf(config)))
    # strict=False: the oracle also lists its shared u, v under every layer (the same Parameter objects) and
    # its inverse frequencies, which it computes; the check below is what matters.
    oracle.load_state_dict(state_dict_to_hf(ours.state_dict()), strict=False)
    x = torch.randint(0, shape.vocab_size, (2, 9))
    with torch.no_grad():
        zeros = ours.init_memory(2, config.mem_len)  # the oracle starts from a zero memory that is attended to
        want = ours.eval()(x[:, :-1], labels=x[:, 1:], memory=zeros).nll  # (2, 8)
        got = oracle.eval()(input_ids=x, labels=x).losses  # (2, 8): the oracle shifts itself
    if not torch.allclose(got.float(), want, atol=1e-4, rtol=1e-4):
        raise RuntimeError("the oracle does not compute what txl's model computes; the comparison would be void")
    return ours, oracle


def autocast(dtype: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


class Runner:
    """One model's steps over its own memory: ``step()`` runs one timed training or evaluation step."""

    def __init__(self, model: torch.nn.Module, name: str, phase: str, dtype: str, data: torch.Tensor,
                 tgt_len: int) -> None:
        self.model, self.name, self.phase, self.dtype = model, name, phase, dtype
        self.data, self.tgt_len = data, tgt_len
        self.i, self.memory, self.cache = 0, None, None
        if phase == "train":
            model.train()
            self.opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        else:
            model.eval()
            self.cache = model.start_kv_cache() if name == "txl" else None

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = (self.data.size(1) - 1) // self.tgt_len
        s = (self.i % n) * self.tgt_len
        self.i += 1
        return self.data[:, s:s + self.tgt_len], self.data[:, s + 1:s + 1 + self.tgt_len]  # (B, T) each

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.name == "txl":
            out = self.model(x, labels=y, memory=self.memory, kv_cache=self.cache)
            self.memory, self.cache = out.memory, out.kv_cache
            return out.loss
        # The oracle scores labels[:, 1:] from hidden[:, :-1] (its own shift): the same number of positions.
        out = self.model(input_ids=x, labels=x, mems=self.memory)
        self.memory = out.mems
        return out.loss if out.loss is not None else out.losses.mean()

    def step(self) -> tuple[float, float]:
        """One step: its wall-clock seconds and the process's CPU seconds."""
        x, y = self.batch()
        t0, c0 = time.perf_counter(), time.process_time()
        if self.phase == "train":
            self.opt.zero_grad(set_to_none=True)
            with autocast(self.dtype):
                loss = self.forward(x, y)
            loss.backward()
            self.opt.step()
        else:
            with torch.no_grad(), autocast(self.dtype):
                self.forward(x, y)
        return time.perf_counter() - t0, time.process_time() - c0


def measure(shape: Shape, phase: str, dtype: str, *, warmup: int, steps: int, seed: int = 0,
            **changes) -> dict:
    """Interleaved steps of txl and the oracle: median seconds per step of each and their ratio."""
    ours, oracle = build_pair(shape, seed, **changes)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, shape.vocab_size, (shape.batch, shape.tgt_len * 8 + 1), generator=g)
    # The oracle's adaptive softmax fails under bf16 autocast (an index_put of bf16 rows into a float32
    # tensor), so txl in bf16 is compared with the oracle in fp32, its fastest.
    oracle_dtype = "fp32"
    runners = [Runner(ours, "txl", phase, dtype, data, shape.tgt_len),
               Runner(oracle, "oracle", phase, oracle_dtype, data, shape.tgt_len)]
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    cpu: dict[str, list[float]] = {r.name: [] for r in runners}
    load = os.getloadavg()[0]
    for i in range(warmup + steps):
        for r in (runners if i % 2 == 0 else runners[::-1]):  # alternate who goes first
            t, c = r.step()
            if i >= warmup:
                times[r.name].append(t)
                cpu[r.name].append(c)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    med_cpu = {name: statistics.median(cs) for name, cs in cpu.items()}
    tokens = shape.batch * shape.tgt_len
    return dict(kind="oracle", phase=phase, dtype=dtype, oracle_dtype=oracle_dtype, batch=shape.batch,
                tgt_len=shape.tgt_len,
                mem_len=shape.mem_len, steps=steps, txl_tokens_per_s=tokens / med["txl"],
                oracle_tokens_per_s=tokens / med["oracle"], speedup=med["oracle"] / med["txl"],
                txl_step_s=med["txl"], oracle_step_s=med["oracle"], cpu_speedup=med_cpu["oracle"] / med_cpu["txl"],
                txl_cpu_s=med_cpu["txl"], oracle_cpu_s=med_cpu["oracle"], load_before=load,
                load_after=os.getloadavg()[0], changes=changes)


def profile(shape: Shape, phase: str, dtype: str, rows: int = 15) -> str:
    """torch.profiler's top operators by self CPU time of one step of each model (after two warm-up steps)."""
    ours, oracle = build_pair(shape)
    data = torch.randint(0, shape.vocab_size, (shape.batch, shape.tgt_len * 8 + 1))
    out = []
    for model, name in ((ours, "txl"), (oracle, "oracle")):
        r = Runner(model, name, phase, dtype, data, shape.tgt_len)
        r.step(), r.step()
        with Profile(torch.device("cpu"), rows=rows) as p:
            r.step()
        out.append(f"== {name} {phase} {dtype}\n{p.table}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.oracle", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="small,base", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--phases", default="train,eval")
    p.add_argument("--dtypes", default="fp32", help="fp32 and/or bf16 (autocast)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", default=None, metavar="SHAPE:PHASE", help="print the profiler tables instead")
    p.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                   help="a txl ModelConfig or ComputeConfig field for txl's model only (e.g. dropout_impl=torch)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    try:
        import transformers
    except ImportError:
        raise SystemExit("benchmarks.oracle needs transformers==4.37.2: pip install -e '.[oracle]'") from None
    changes = {}
    for item in args.model:
        key, _, value = item.partition("=")
        changes[key] = {"true": True, "false": False}.get(value.lower(), value)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads")
    if args.profile:
        shape_name, _, phase = args.profile.partition(":")
        print(profile(SHAPES[shape_name], phase or "train", args.dtypes.split(",")[0]))
        return
    rows = []
    for name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for phase in args.phases.split(","):
                r = dict(shape=name, **measure(SHAPES[name], phase, dtype, warmup=args.warmup, steps=args.steps,
                                               **changes))
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n{'shape':<6} {'phase':<6} {'dtype':<5} {'txl tok/s':>10} {'oracle tok/s':>12} {'txl/oracle':>10} "
          f"{'(CPU time)':>10} {'load':>10}")
    for r in rows:
        print(f"{r['shape']:<6} {r['phase']:<6} {r['dtype']:<5} {r['txl_tokens_per_s']:>10,.0f} "
              f"{r['oracle_tokens_per_s']:>12,.0f} {r['speedup']:>9.2f}x {r['cpu_speedup']:>9.2f}x "
              f"{r['load_before']:>4.1f}-{r['load_after']:<4.1f}")


if __name__ == "__main__":
    sys.exit(main())
