"""How far apart FSDP, DDP and one process end, and a sharded checkpoint resumed at another process count.

    python -m benchmarks.equality --out /tmp/txl-equality      # ~2 min on 2 busy cores

The runs of tests/test_scale.py, with the figures printed instead of asserted: one global batch of 8 streams
(tiny model, fp32, dropout 0, 6 steps) in one process, DDP over 2 (2 accumulation chunks each), FSDP2 over 2
with activation checkpointing; then the FSDP run's step-3 checkpoint resumed at 1 and at 4 processes. Printed:
the largest difference of the per-step training losses and of the final weights against the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import txl

TINY = ["--preset", "tiny", "--model.n_layer", "2", "--model.d_model", "32", "--model.n_head", "2",
        "--model.d_head", "16", "--model.d_inner", "64", "--model.mem_len", "8", "--model.dropout", "0",
        "--train.tgt_len", "8", "--train.log_interval", "1", "--train.progress", "false",
        "--train.tensorboard", "false", "--train.plot", "false", "--eval.batch_size", "4", "--eval.mem_len", "16",
        "--train.eval_batches", "2", "--train.eval_interval", "0", "--train.keep_last", "10",
        "--max-steps", "6", "--train.batch_size", "8", "--train.ckpt_interval", "3"]


def train(out: Path, corpus: Path, nproc: int, *more: str, resume: Path | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(out.parent / "cache")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    rest = ["--resume", str(resume)] if resume else [*TINY, "--data.corpus", str(corpus), "--data.level", "byte",
                                                     "--out", str(out), *more]
    proc = subprocess.run([*launch, "-m", "txl", "train", *rest], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def weight_difference(a: Path, b: Path) -> float:
    x, y = txl.from_pretrained(a).state_dict(), txl.from_pretrained(b).state_dict()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/txl-equality", help="scratch directory (emptied first)")
    root = Path(p.parse_args().out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    corpus = root / "code.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    single, ddp, fsdp, one, four = (root / n for n in ("single", "ddp", "fsdp", "one", "four"))
    train(single, corpus, 1)
    train(ddp, corpus, 2, "--train.grad_accum", "2")
    train(fsdp, corpus, 2, "--train.grad_accum", "2", "--train.parallel", "fsdp", "--train.activation_checkpointing")
    for copy in (one, four):
        shutil.copytree(fsdp, copy)
    train(one, corpus, 1, resume=one / "checkpoints" / "step_00000003")
    train(four, corpus, 4, resume=four / "checkpoints" / "step_00000003")
    last = Path("checkpoints") / "step_00000006"
    print("| run | against | steps | max abs loss difference | max abs final weight difference |")
    print("|---|---|---|---|---|")
    rows = [("DDP, 2 processes x 2 chunks", ddp, single, range(1, 7)),
            ("FSDP2 + act. ckpt, 2 x 2", fsdp, single, range(1, 7)),
            ("FSDP2 + act. ckpt, 2 x 2", fsdp, ddp, range(1, 7)),
            ("FSDP step 3 resumed at 1 process", one, fsdp, range(4, 7)),
            ("FSDP step 3 resumed at 4 processes", four, fsdp, range(4, 7))]
    for name, run, ref, steps in rows:
        a, b = losses(run), losses(ref)
        loss = max(abs(a[s] - b[s]) for s in steps)
        print(f"| {name} | {ref.name} | {steps.start}-{steps.stop - 1} | {loss:.2e} | "
              f"{weight_difference(run / last, ref / last):.2e} |")


if __name__ == "__main__":
    main()
