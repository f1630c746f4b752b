"""Training: `train(run_config)` wires the corpus, model, optimiser, iterator, checkpoints and logs.

Each optimiser step reads one segment of every stream. The global batch of B streams is split over W
processes (DDP) and, within a process, into ``grad_accum`` chunks; every chunk keeps its own memory
(Dai et al. 2019, section 3.2), so the result equals one process reading all B streams at once.
The training state is small and complete (step, tokens, RNG states, iterator position, memories) and
resuming from a checkpoint reproduces the uninterrupted run bit for bit on the same hardware.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txl import checkpoint as ckpt
from txl.config import RunConfig
from txl.data import Batch, Corpus, OrderedIterator
from txl.distributed import (
    DistInfo,
    OtherRankFailed,
    all_reduce_min,
    all_reduce_sum,
    any_true,
    barrier,
    init_distributed,
    shutdown,
)
from txl.evaluate import EvalResult, autocast, evaluate, metric_value
from txl.model import Memory, TransformerXL
from txl.optim import build_optimizer, lr_at, set_lr
from txl.pretrained import load_weights, read_state
from txl.rundir import RunDirError, RunLock, open_run_dir
from txl.runtime import compile_model, cpu_has_native_bf16, matmul_precision, resolve_precision
from txl.signals import Stopped, StopRequest

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, checkpoint write failed); the message says what to do."""


@dataclass
class TrainState:
    """What, besides weights and optimiser, a resumed run needs."""

    step: int = 0
    tokens: int = 0
    best_valid: float = math.inf
    horizon: int = 0
    """The step the schedule decays to: max_steps, or fewer when a time budget ends the run first
    (calibrated once from the measured step rate and saved, so a resumed run keeps the same schedule)."""
    memories: list[Memory | None] = field(default_factory=list)
    """One memory per accumulation chunk of this process's streams."""


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    valid: EvalResult | None
    test: EvalResult | None
    sample: str | None
    stopped: str
    """'max_steps' or 'time'."""


@dataclass
class StepStats:
    loss: float
    tokens: int
    lr: float
    grad_norm: float


# -- one step -------------------------------------------------------------------------------------------

def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               batch: Batch, memories: list[Memory | None], *, lr: float, clip: float, precision: str,
               info: DistInfo) -> tuple[StepStats, list[Memory | None]]:
    """Forward/backward every accumulation chunk with its own memory, then one clipped optimiser step.

    Each chunk's mean loss is weighted by its share of the tokens, so the gradient is that of the mean
    over the whole (local) batch; DDP averages it over processes, which hold equal token counts.
    """
    set_lr(optimizer, lr)
    chunks = list(zip(batch.input_ids.chunk(len(memories)), batch.labels.chunk(len(memories))))
    n_total = int((batch.labels != IGNORE_INDEX).sum())
    new_memories, nll_sum = [], 0.0
    for i, ((x, y), memory) in enumerate(zip(chunks, memories)):
        last = i == len(chunks) - 1
        sync = contextlib.nullcontext() if last or not info.enabled else model.no_sync()
        with sync:
            with autocast(info.device, precision):
                out = model(x, labels=y, memory=memory)
            n = int((y != IGNORE_INDEX).sum())
            scaler.scale(out.loss * (n / n_total)).backward()
        new_memories.append(out.memory)
        nll_sum += float(out.loss.detach().double()) * n
    nll_sum, count = all_reduce_sum([nll_sum, float(n_total)], info)
    loss = nll_sum / count
    if not math.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        return StepStats(loss, int(count), lr, float("nan")), new_memories
    scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(loss, int(count), lr, float(grad_norm)), new_memories


def batches(it: OrderedIterator) -> Iterator[Batch]:
    """Segments forever, epoch after epoch."""
    while True:
        yield from it


# -- state ----------------------------------------------------------------------------------------------

def rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()  # tensors and numbers only: weights_only loads it
    state = {"torch": torch.get_rng_state(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos,
                                                       has_gauss, gauss], "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather(local: tuple[Any, Any], info: DistInfo) -> tuple[list[Any], list[Any]]:
    """Every process's (RNG state, memories), in rank order, so the main process can save them all."""
    if not info.enabled:
        return [local[0]], [local[1]]
    import torch.distributed as dist
    parts: list[Any] = [None] * info.world_size
    dist.all_gather_object(parts, local)
    return [p[0] for p in parts], [p[1] for p in parts]


def _cpu(memories: list[Memory | None]) -> list[Any]:
    return [None if m is None else tuple(t.cpu() for t in m) for m in memories]


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when installed) on the main process; nothing elsewhere."""

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: int | None) -> None:
        self.path, self.enabled, self.tb = out_dir / "metrics.jsonl", enabled, None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():  # drop rows the resumed steps will rewrite
            rows = [r for r in self.path.read_text(encoding="utf-8").splitlines()
                    if r.strip() and json.loads(r).get("step", 0) <= resume_step]
            self.path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
        elif resume_step is None:
            self.path.write_text("", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(out_dir / "tb"))
            except ImportError:
                log.info("tensorboard is not installed (pip install 'txl[tb]'): metrics go to %s only", self.path)

    def write(self, kind: str, step: int, **values: float) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# -- wiring ---------------------------------------------------------------------------------------------

def train(cfg: RunConfig, *, resume: str | Path | None = None, corpus: Corpus | None = None,
          overwrite: bool = False) -> TrainResult:
    """Train as ``cfg`` says (or continue the run in ``resume``); validate, checkpoint, test, sample.

    A fresh run refuses a run directory that already holds files unless ``overwrite`` (which deletes
    them); one process at a time may train into a directory (``txl.rundir``). SIGTERM and SIGINT stop
    the run at the next step boundary with a checkpoint and raise ``txl.signals.Stopped``.
    """
    from txl.data.corpora import load_run_corpus

    info = init_distributed(cfg.train.device)
    lock = None
    try:
        lock = _open_run_dir(Path(cfg.train.out_dir), resume is not None, overwrite, info)
        corpus = corpus or load_run_corpus(cfg.data)
        cfg = cfg.replace(model=cfg.model.replace(vocab_size=corpus.vocab_size))
        check_splits_fit(cfg, corpus)
        with matmul_precision(info.device, tf32=cfg.train.tf32), StopRequest() as stop:  # for this run only
            result = _train(cfg, corpus, info, resume, stop)
        barrier(info)  # no process tears the group down while another still tests, plots or samples
        return result
    finally:
        shutdown(info)
        if lock is not None:
            lock.release()


def check_splits_fit(cfg: RunConfig, corpus: Corpus) -> None:
    """Refuse a segment length the validation or test split cannot fill once per evaluation stream:
    the evaluation would otherwise silently measure a handful of tokens."""
    e = cfg.eval
    for split, tokens, tgt_len, flag in (("validation", corpus.valid, cfg.train.tgt_len, "--train.tgt_len"),
                                         ("test", corpus.test, e.tgt_len or cfg.train.tgt_len,
                                          "--eval.tgt_len" if e.tgt_len else "--train.tgt_len")):
        need = e.batch_size * tgt_len + 1
        if len(tokens) < need:
            raise ValueError(f"the {split} split has {len(tokens):,} tokens, fewer than eval.batch_size x tgt_len + 1 "
                             f"= {e.batch_size} x {tgt_len} + 1 = {need:,}: use a smaller {flag} or "
                             "--eval.batch_size, or a corpus with a larger split")


def _open_run_dir(out: Path, resume: bool, overwrite: bool, info: DistInfo) -> RunLock | None:
    """The main process locks and checks the run directory; every process learns whether it may go on."""
    lock, refusal = None, None
    if info.is_main:
        try:
            lock = open_run_dir(out, resume=resume, overwrite=overwrite)
        except RunDirError as err:
            refusal = err
    if any_true(refusal is not None, info) and refusal is None:
        raise OtherRankFailed("the main process refused the run directory")
    if refusal is not None:
        raise refusal
    return lock


def _train(cfg: RunConfig, corpus: Corpus, info: DistInfo, resume: str | Path | None,
           stop: StopRequest) -> TrainResult:
    t, out = cfg.train, Path(cfg.train.out_dir)
    if t.batch_size % (info.world_size * t.grad_accum):
        raise ValueError(f"train.batch_size={t.batch_size} must be divisible by {info.world_size} processes x "
                         f"grad_accum={t.grad_accum}")
    if t.precision == "fp16" and info.device.type != "cuda":
        raise ValueError("train.precision='fp16' needs CUDA; use --train.precision bf16 on CPU")
    precision = resolve_precision(t.precision, info.device)  # 'auto': bf16 on a GPU that has it, else fp32
    if precision == "bf16" and info.device.type == "cpu" and cpu_has_native_bf16() is False:
        log.warning("train.precision=bf16: this CPU has no bf16 matrix instructions (AVX512_BF16 or AMX), so "
                    "bf16 autocast makes its matmuls many times slower than fp32; --train.precision fp32 is faster")
    torch.manual_seed(t.seed)
    model = TransformerXL(cfg.model).to(info.device)
    torch.manual_seed(t.seed + info.rank)  # same weights everywhere, different dropout per process
    optimizer = build_optimizer(model, cfg.optim)
    scaler = torch.amp.GradScaler(info.device.type, enabled=precision == "fp16")
    it = OrderedIterator(corpus.train, batch_size=t.batch_size, tgt_len=t.tgt_len, ext_len=cfg.model.ext_len,
                         var_len=t.var_len, seed=t.seed, rank=info.rank, world_size=info.world_size,
                         device=info.device)
    state = TrainState(memories=[None] * t.grad_accum)
    if resume is not None:
        _restore(resume, model, optimizer, scaler, it, state, corpus, info)
    elif info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(out / ckpt.RUN_FILE, cfg.to_dict())
    if info.is_main:
        ckpt.clean_partial(out)
    ddp = model
    if info.enabled:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            find_unused_parameters=bool(cfg.model.cutoffs))  # an unseen cluster gets no gradient
    step_model = compile_model(ddp, t.compile)  # DDP first, then compile: dynamo splits at DDP's buckets
    metrics = MetricsLog(out, enabled=info.is_main, tensorboard=t.tensorboard,
                         resume_step=state.step if resume is not None else None)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %s parameters; corpus %s: %s train tokens, vocab %s, metric %s; %d process(es) on %s",
             f"{n_params:,}", corpus.name, f"{len(corpus.train):,}", corpus.vocab_size, corpus.metric,
             info.world_size, info.device)

    def validate(max_batches: int) -> EvalResult:
        return evaluate(model, corpus.valid, metric=corpus.metric, batch_size=cfg.eval.batch_size,
                        tgt_len=t.tgt_len, max_batches=max_batches, precision=precision, info=info,
                        compile=cfg.eval.compile)

    saved_at: list[int | None] = [None]  # the step of the last checkpoint this run wrote

    def save(best: bool, valid: EvalResult | None) -> Path | None:
        """Write a checkpoint of this step (the main process returns its path); refuse diverged ones."""
        _check_finite(model, valid, state.step, out, info)
        rngs, memories = gather((rng_state(info.device), _cpu(state.memories)), info)
        path = None
        if info.is_main:
            extra = {"valid_loss": valid.loss} if valid else {}
            payload = {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": state.step,
                       "tokens": state.tokens, "best_valid": state.best_valid, "horizon": state.horizon, "rng": rngs,
                       "iterator": it.state_dict(), "memories": memories, "world_size": info.world_size}
            try:
                path = ckpt.save_checkpoint(out, step=state.step, model=model, run=cfg, tokenizer=corpus.tokenizer,
                                     state=payload, best=best, keep_last=t.keep_last, info=extra)
            except ckpt.CheckpointError as err:
                raise TrainingError(str(err)) from err
        barrier(info)
        saved_at[0] = state.step
        return path

    def stop_here() -> None:
        """At a step boundary: on SIGTERM/SIGINT (on any process) checkpoint this step and stop."""
        if any_true(stop.requested, info):
            sig = stop.signal or signal.SIGTERM  # a process that saw none follows the one that did
            if saved_at[0] != state.step:  # the same on every process: save() is collective
                save(False, None)
            saved = ckpt._pointer(out, "latest") if info.is_main else None
            metrics.close()
            raise Stopped(sig, state.step, saved, out)

    bar = _progress(t, state.step, info)
    start, stopped, seen_since, time_since = time.perf_counter(), "max_steps", 0, time.perf_counter()
    stream = batches(it)
    valid = None
    start_step = state.step
    while state.step < (state.horizon or t.max_steps):
        elapsed = time.perf_counter() - start
        if t.minutes and not state.horizon and state.step - start_step == CALIBRATION_STEPS:
            state.horizon = _time_horizon(state.step, state.step - start_step, elapsed, t.minutes * 60,
                                          t.max_steps, info)
            if state.horizon < t.max_steps:
                log.info("time budget of %g min: the schedule decays over %d steps (max_steps %d)",
                         t.minutes, state.horizon, t.max_steps)
        if t.minutes and not info.enabled and elapsed > t.minutes * 60:  # safety net; DDP stops at the horizon
            stopped = "time"
            break
        batch = next(stream)
        if batch.start == 0:  # a new epoch: streams restart, nothing to remember
            state.memories = [None] * t.grad_accum
        lr = lr_at(state.step, cfg.optim, state.horizon or t.max_steps)
        stats, state.memories = train_step(step_model, optimizer, scaler, batch, state.memories, lr=lr,
                                           clip=cfg.optim.clip, precision=precision, info=info)
        if not math.isfinite(stats.loss):
            latest = ckpt._pointer(out, "latest") if info.is_main else None
            raise TrainingError(
                f"loss is {stats.loss} at step {state.step + 1}: training stopped. The last good checkpoint is "
                f"{latest or 'none (nothing was saved yet)'}. Lower --optim.lr, add --optim.warmup_steps, or "
                "use --train.precision fp32, then resume or restart")
        state.step += 1
        state.tokens += stats.tokens
        seen_since += stats.tokens
        if state.step % t.log_interval == 0 or state.step == t.max_steps:
            now = time.perf_counter()
            tok_s = seen_since / max(now - time_since, 1e-9)
            seen_since, time_since = 0, now
            metrics.write("train", state.step, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                          tokens=state.tokens, tokens_per_s=tok_s)
            bar.set_postfix({"loss": f"{stats.loss:.3f}",
                             corpus.metric: f"{metric_value(stats.loss, corpus.metric):.3f}",
                             "tok/s": f"{tok_s:,.0f}"})
        bar.update(1)
        is_eval = t.eval_interval and state.step % t.eval_interval == 0 and state.step < t.max_steps
        if is_eval:
            valid = validate(t.eval_batches)
            metrics.write("valid", state.step, loss=valid.loss, **{corpus.metric: valid.value})
            log.info("step %d: valid %s", state.step, valid.describe())
        if is_eval or (t.ckpt_interval and state.step % t.ckpt_interval == 0 and state.step < t.max_steps):
            best = valid is not None and valid.loss < state.best_valid and is_eval
            if best:
                state.best_valid = valid.loss
            save(best, valid if is_eval else None)
        stop_here()
    bar.close()

    valid = validate(0)
    metrics.write("valid", state.step, loss=valid.loss, **{corpus.metric: valid.value})
    log.info("final valid (%d steps): %s", state.step, valid.describe())
    best = valid.loss < state.best_valid
    state.best_valid = min(state.best_valid, valid.loss)
    save(best, valid)
    stop_here()  # a signal during the final validation: the final checkpoint is written, skip the test
    if not best:
        _load_best(out, model, info)
    e = cfg.eval
    test = evaluate(model, corpus.test, metric=corpus.metric, batch_size=e.batch_size, tgt_len=e.tgt_len or t.tgt_len,
                    mem_len=e.mem_len, clamp_len=e.clamp_len, same_length=e.same_length, ext_len=e.ext_len,
                    precision=precision, info=info, compile=e.compile)
    mem = e.mem_len if e.mem_len is not None else cfg.model.mem_len
    metrics.write("test", state.step, loss=test.loss, mem_len=mem, **{corpus.metric: test.value})
    log.info("test (mem_len %d, trained with %d): %s", mem, cfg.model.mem_len, test.describe())
    metrics.close()
    sample = None
    if info.is_main:
        if t.plot:
            plot_learning_curve(out / "metrics.jsonl", out / "learning_curve.png", corpus.metric)
        if t.sample_tokens:
            sample = _sample(model, corpus, t.sample_tokens, mem_len=mem, seed=t.seed)
    if state.horizon and state.horizon < t.max_steps and stopped == "max_steps":
        stopped = "time"
    return TrainResult(out_dir=out, steps=state.step, valid=valid, test=test, sample=sample, stopped=stopped)


def _check_finite(model: torch.nn.Module, valid: EvalResult | None, step: int, out: Path, info: DistInfo) -> None:
    """Raise rather than checkpoint diverged weights or a non-finite validation loss: ``latest`` must
    always name weights a run can resume from (and latest.json stays valid JSON, which has no NaN)."""
    bad = None
    if valid is not None and not math.isfinite(valid.loss):
        bad = f"the validation loss is {valid.loss}"
    elif not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        bad = "the weights hold non-finite values"
    if bad is None:
        return
    latest = ckpt._pointer(out, "latest") if info.is_main else None
    raise TrainingError(
        f"{bad} at step {step}: training diverged and this step was not saved. The last good checkpoint is "
        f"{latest or 'none (nothing was saved yet)'}. Lower --optim.lr, add --optim.warmup_steps, or use "
        "--train.precision fp32, then resume from it or restart")


CALIBRATION_STEPS = 20
"""Steps timed before a time budget fixes the schedule's horizon."""


def _time_horizon(step: int, steps_timed: int, elapsed: float, budget: float, max_steps: int,
                  info: DistInfo) -> int:
    """The last step that fits in the time budget at the measured rate (90%: evaluations take time too).

    Every rank gets the same answer (the smallest), so distributed runs stop together.
    """
    rate = steps_timed / max(elapsed, 1e-9)
    horizon = min(max_steps, step + int(0.9 * rate * max(budget - elapsed, 0.0)))
    if info.enabled:
        horizon = int(all_reduce_min([float(horizon)], info)[0])
    return max(horizon, step + 1)


def _progress(t: Any, initial: int, info: DistInfo) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not t.progress or not info.is_main:
        class _Null:
            def update(self, n: int) -> None: ...
            def set_postfix(self, values: dict) -> None: ...
            def close(self) -> None: ...
        return _Null()
    return tqdm(total=t.max_steps, initial=initial, unit="step", dynamic_ncols=True)


def _restore(resume: str | Path, model: TransformerXL, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, it: OrderedIterator, state: TrainState, corpus: Corpus,
             info: DistInfo) -> None:
    loaded = ckpt.load_checkpoint(resume, device=info.device)
    ckpt.check_tokenizer(loaded.path, corpus.tokenizer)
    if loaded.model.config.to_dict() | {"mem_len": 0} != model.config.to_dict() | {"mem_len": 0}:
        raise ValueError(f"the checkpoint {loaded.path} was trained with another model config; resume with "
                         "the run's own config (txl train --resume DIR takes it from the checkpoint)")
    s = loaded.state
    if s.get("world_size", 1) != info.world_size:
        raise ValueError(f"the checkpoint was written by {s.get('world_size')} process(es); resume with the "
                         "same number, since each process's memory is part of the state")
    model.load_state_dict(loaded.model.state_dict())
    optimizer.load_state_dict(s["optimizer"])
    scaler.load_state_dict(s["scaler"])
    it.load_state_dict(s["iterator"])
    state.step, state.tokens, state.best_valid = int(s["step"]), int(s["tokens"]), float(s["best_valid"])
    state.horizon = int(s.get("horizon", 0))
    memories = s["memories"][info.rank]
    if len(memories) != len(state.memories):
        raise ValueError(f"the checkpoint was trained with grad_accum={len(memories)}; resume with the same "
                         "value (each accumulation chunk's memory is part of the state)")
    state.memories = [None if m is None else tuple(x.to(info.device) for x in m) for m in memories]
    set_rng_state(s["rng"][info.rank], info.device)
    log.info("resumed from %s at step %d", loaded.path, state.step)


def _load_best(out: Path, model: TransformerXL, info: DistInfo) -> None:
    """Load the best checkpoint's weights (by validation loss) for the test evaluation."""
    best = ckpt._pointer(out, "best")
    if best is None or not best.is_dir():
        return
    weights, source = read_state(best)
    load_weights(model, weights, source=source)
    model.to(info.device)
    log.info("testing the best checkpoint %s", best)


def plot_learning_curve(metrics_path: Path, png: Path, metric: str) -> bool:
    """Train and valid loss against step; False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed (pip install 'txl[cli]'): no learning-curve plot")
        return False
    rows = [json.loads(r) for r in metrics_path.read_text(encoding="utf-8").splitlines() if r.strip()]
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in ("train", "valid"):
        pts = [(r["step"], r["loss"]) for r in rows if r["kind"] == kind]
        if pts:
            ax.plot(*zip(*pts), label=kind, marker="o" if kind == "valid" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"learning curve ({metric})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


@torch.no_grad()
def _sample(model: TransformerXL, corpus: Corpus, n: int, *, mem_len: int, seed: int,
            temperature: float = 0.8, prompt_len: int = 64) -> str:
    """A temperature-sampled continuation of the test split's first tokens, prompt and continuation
    marked (``txl generate`` exposes every sampling option)."""
    from txl.generate import generate

    device = next(model.parameters()).device
    prompt = torch.as_tensor(np.asarray(corpus.test[:prompt_len], dtype=np.int64), device=device)[None]  # (1, P)
    new = generate(model, prompt, max_new_tokens=n, temperature=temperature, seed=seed, mem_len=mem_len)  # (1, n)
    decode = corpus.tokenizer.decode
    return decode(prompt[0].tolist()) + " >>> " + decode(new[0].tolist())
