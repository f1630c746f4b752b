"""DDP and FSDP2 on one device: the parallel code a single-GPU machine can run, against the plain model.

``txl train`` forms a process group only for two processes or more (torchrun with one process is a plain run),
so on a machine with one GPU NCCL, FSDP2 and its bf16 ``MixedPrecisionPolicy`` never run. This joins a process
group of one (NCCL on a GPU, gloo on a CPU) and trains the same model, on the same batches, with the library's
own step (``txl.train.train_step``) three ways: plain, DDP-wrapped, and sharded by ``txl.parallel.shard``
(FSDP2 over a one-device mesh). Then the FSDP run's model and optimiser state go through a distributed
checkpoint (``torch.distributed.checkpoint``, as the trainer writes them) into a fresh sharded model, which must
continue exactly as the original. Printed: the largest per-step loss and final-weight differences.

    python -m benchmarks.parallel_one --device cuda                   # fp32 and bf16
    python -m benchmarks.parallel_one --device cpu --precisions fp32  # the same code on a CPU (gloo)

In fp32 the three must agree to rounding. In bf16 on a GPU, FSDP2 computes with bf16 parameters (its
mixed-precision policy, fp32 gradient reduction) where the plain run autocasts, so they differ by bf16 rounding
and the figure is the size of that; on a CPU all three autocast. The last column trains a sharded model that
was not loaded from the checkpoint: it must differ, or the round trip proves nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch
import torch.distributed as dist

import txl
from txl import parallel
from txl.config import OptimConfig
from txl.data import Batch
from txl.distributed import DistInfo
from txl.optim import build_optimizer
from txl.train import read_stats, train_step


def config() -> txl.ModelConfig:
    # Two tail clusters (the reduce-scatter of unused parameters) and tied projections: the parts FSDP shards
    # specially.
    return txl.ModelConfig(vocab_size=300, n_layer=3, d_model=64, n_head=4, d_head=16, d_inner=128, mem_len=16,
                           dropout=0.0, cutoffs=[50, 150], div_val=2, d_embed=64)


def batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, config().vocab_size, (4, n * 16 + 1), generator=g)  # (B, n T + 1)
    return [(stream[:, s * 16:(s + 1) * 16].to(device), stream[:, s * 16 + 1:(s + 1) * 16 + 1].to(device))
            for s in range(n)]


def build(kind: str, info: DistInfo, precision: str):
    # txl.parallel.wrap leaves a model of one process alone (DistInfo.enabled), so the group of one is wrapped
    # here, as wrap would wrap it in a group of many.
    torch.manual_seed(0)
    model = txl.TransformerXL(config()).to(info.device).train()
    if kind == "fsdp":
        parallel.shard(model, info, precision=precision)
        step_model = model
    elif kind == "ddp":
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            find_unused_parameters=True)
    else:
        step_model = model
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    return model, step_model, optimizer


def train(step_model, optimizer, info: DistInfo, precision: str, data, memories=None):
    """Losses of one step per batch (the library's step, memory carried) and the memories after."""
    scaler = torch.amp.GradScaler(info.device.type, enabled=precision == "fp16")
    memories = memories or [None]
    steps = []
    for s, (x, y) in enumerate(data):
        batch = Batch(input_ids=x, labels=y, context_len=0, start=s * x.shape[1])
        stats, memories = train_step(step_model, optimizer, scaler, batch, memories, lr=1e-3, clip=0.25,
                                     precision=precision, info=info)
        steps.append(stats)
    return [s.loss for s in read_stats(steps)], memories  # the figures stay on the device until here


def full_weights(model) -> dict[str, torch.Tensor]:
    with parallel.gathered(model):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu().clone()
                for k, v in model.state_dict().items()}


def largest(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def compare(info: DistInfo, precision: str, steps: int) -> dict:
    data = batches(steps + 3, info.device)
    first, rest = data[:steps], data[steps:]
    runs = {}
    for kind in ("plain", "ddp", "fsdp"):
        model, step_model, optimizer = build(kind, info, precision)
        losses, memories = train(step_model, optimizer, info, precision, first)
        runs[kind] = dict(model=model, optimizer=optimizer, losses=losses, memories=memories)
    weights = {k: full_weights(r["model"]) for k, r in runs.items()}
    # The FSDP run's state through a distributed checkpoint into a fresh sharded model: continued, it must
    # match the original continuing.
    import torch.distributed.checkpoint as dcp

    fsdp = runs["fsdp"]
    with tempfile.TemporaryDirectory() as tmp:
        model_state, optim_state = parallel.state_dicts(fsdp["model"], fsdp["optimizer"])
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=dcp.FileSystemWriter(tmp))
        model, _, optimizer = build("fsdp", info, precision)
        model_state, optim_state = parallel.state_dicts(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=dcp.FileSystemReader(tmp))
        parallel.load_state_dicts(model, optimizer, state["model"], state["optim"])
    resumed, _ = train(model, optimizer, info, precision, rest, fsdp["memories"])
    fresh, _, fresh_optimizer = build("fsdp", info, precision)  # not loaded: shows the check can fail
    not_loaded, _ = train(fresh, fresh_optimizer, info, precision, rest, fsdp["memories"])
    continued, _ = train(fsdp["model"], fsdp["optimizer"], info, precision, rest, fsdp["memories"])
    return dict(precision=precision, device=str(info.device), steps=steps,
                ddp_vs_plain_loss=largest(runs["ddp"]["losses"], runs["plain"]["losses"]),
                fsdp_vs_plain_loss=largest(runs["fsdp"]["losses"], runs["plain"]["losses"]),
                ddp_vs_plain_weights=weight_gap(weights["ddp"], weights["plain"]),
                fsdp_vs_plain_weights=weight_gap(weights["fsdp"], weights["plain"]),
                resumed_vs_continued_loss=largest(resumed, continued),
                not_loaded_vs_continued_loss=largest(not_loaded, continued),
                final_loss_plain=runs["plain"]["losses"][-1])


def join_group_of_one(device: torch.device) -> None:
    """A process group of one: NCCL for a GPU, gloo for a CPU. Its store is in this process (no port to find)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            store=dist.HashStore(), device_id=device if device.type == "cuda" else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parallel_one", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--precisions", default=None, help="comma-separated: fp32, bf16 (default: both on a GPU, fp32 "
                                                      "on a CPU)")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    precisions = (args.precisions or ("fp32,bf16" if device.type == "cuda" else "fp32")).split(",")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give at least 1")
    torch.set_num_threads(1)
    join_group_of_one(device)
    try:
        info = DistInfo(rank=0, world_size=1, device=device)
        rows = [compare(info, precision, args.steps) for precision in precisions]
    finally:
        dist.destroy_process_group()
    print(f"backend {'nccl' if device.type == 'cuda' else 'gloo'}, one process, {device}; {args.steps} steps, "
          "then 3 more after a distributed-checkpoint round trip")
    print("| precision | DDP vs plain loss | FSDP2 vs plain loss | DDP weights | FSDP2 weights | resumed vs continued "
          "| (not loaded vs continued) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['ddp_vs_plain_loss']:.2e} | {r['fsdp_vs_plain_loss']:.2e} | "
              f"{r['ddp_vs_plain_weights']:.2e} | {r['fsdp_vs_plain_weights']:.2e} | "
              f"{r['resumed_vs_continued_loss']:.2e} | ({r['not_loaded_vs_continued_loss']:.2e}) |")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
