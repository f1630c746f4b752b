"""Training: `train(run_config)` wires the corpus, model, optimiser, state, checkpoints and metrics.

Each optimiser step reads one segment of every stream. The global batch of B streams is split over W
processes (DDP) and, within a process, into ``grad_accum`` chunks; every chunk keeps its own memory
(Dai et al. 2019, section 3.2), so the result equals one process reading all B streams at once.

The parts: ``train_step`` (one optimiser step), ``TrainState`` (txl.train_state: counters, schedule,
iterator, RNG, memory), ``Checkpointer`` (txl.checkpoint: the checkpoint is the dict of the stateful
parts under fixed keys), ``MetricsLog`` and ``ProgressBar`` (txl.metrics). ``Trainer`` only wires them
together; resuming from a checkpoint reproduces the uninterrupted run bit for bit on the same hardware.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txl import checkpoint as ckpt
from txl import elastic, parallel
from txl.config import Context, LossPositions, ModelConfig, RunConfig, SampleConfig
from txl.data import Batch, Corpus, OrderedIterator, eval_iterator
from txl.distributed import (
    DistInfo,
    OtherRankFailed,
    PeerDied,
    all_reduce_min,
    all_reduce_sum_tensor,
    any_true,
    barrier,
    init_distributed,
    naming_dead_peers,
    shutdown,
)
from txl.evaluate import EvalResult, autocast, check_split_fits, evaluate, fit_capacity, metric_value, sizes_capacity
from txl.fileio import remove_partial
from txl.graphs import StaticSteps
from txl.labels import IGNORE_INDEX
from txl.metrics import PLOT_FILE, MetricsLog, ProgressBar, plot_learning_curve, segment_progress
from txl.model import Memory, TransformerXL
from txl.model.transformer import check_token_ids
from txl.optim import build_optimizer, lr_at, set_lr
from txl.pretrained import load_weights, read_state
from txl.rundir import CKPT_DIR, RunDirError, RunLock, open_run_dir
from txl.runtime import compile_model, cpu_has_native_bf16, matmul_precision, resolve_precision
from txl.signals import Interrupted, Stopped, StopRequest
from txl.step_graph import StepGraph, graphs_mode, with_float_lr
from txl.step_stats import StepStats, read_stats  # noqa: F401 (read_stats: txl.train.read_stats, as before)
from txl.train_state import TrainState

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, checkpoint write failed); the message says what to do."""


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    valid: EvalResult | None
    test: EvalResult | None
    sample: str | None
    stopped: str
    """'max_steps' or 'time'."""
    valid_context: str = ""
    """The evaluation settings of ``valid`` (segment and memory lengths, streams), to print beside it."""
    test_context: str = ""
    best_step: int = 0
    """The step of the checkpoint that was tested."""


# -- one step -------------------------------------------------------------------------------------------

def loss_labels(batch: Batch, loss_positions: LossPositions) -> torch.Tensor:
    """The batch's labels with the positions the loss skips set to IGNORE_INDEX: (B, C + T) int64.

    'last_half' (the paper's 'Half' loss, after Al-Rfou et al. 2018) ignores the first T // 2 segment
    positions besides the C carried-context ones, so the cross-entropy covers the last T - T // 2.
    The model's mean loss then averages over those only, and the ignored targets send no gradient.
    """
    if loss_positions == "all":
        return batch.labels
    labels = batch.labels.clone()  # the iterator's tensor is left as it is
    labels[:, : batch.context_len + batch.tgt_len // 2] = IGNORE_INDEX  # (B, C + T)
    return labels


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               batch: Batch, memories: list[Memory | None], *, lr: float | torch.Tensor, clip: float, precision: str,
               info: DistInfo, loss_positions: LossPositions = "all") -> tuple[StepStats, list[Memory | None]]:
    """Forward/backward every accumulation chunk with its own memory, then one clipped optimiser step.

    Each chunk's mean loss is weighted by its share of the scored tokens, so the gradient is that of the
    mean over the whole (local) batch; DDP averages it over processes, which hold equal token counts.
    ``loss_positions`` chooses the scored positions (``loss_labels``). Nothing here waits on the host, so
    ``txl.step_graph`` records it whole as a CUDA graph (``lr`` then a tensor on the device).
    """
    set_lr(optimizer, lr)
    batch = dataclasses.replace(batch, labels=loss_labels(batch, loss_positions))
    chunks = list(zip(batch.input_ids.chunk(len(memories)), batch.labels.chunk(len(memories))))
    # Counts, losses and the norm stay on the device (no host sync inside a step): the caller reads them later.
    alone = len(chunks) == 1 and not info.enabled  # nothing to weigh nor to reduce: the model's figures are the step's
    n_total = None if alone else (batch.labels != IGNORE_INDEX).sum()  # () int64
    new_memories, nll_sum, aux_sum = [], None, None
    for i, ((x, y), memory) in enumerate(zip(chunks, memories)):
        last = i == len(chunks) - 1
        sync = contextlib.nullcontext() if last or not info.enabled else parallel.no_sync(model)
        with sync:
            with autocast(info.device, precision):
                out = model(x, labels=y, memory=memory)
            # One chunk (no accumulation) is the whole batch: its weight n / n_total is 1, not computed (4 kernels).
            n = n_total if len(chunks) == 1 else (y != IGNORE_INDEX).sum()  # () int64
            loss = out.loss if len(chunks) == 1 else out.loss * (n / n_total)
            if out.compression_loss is not None:  # its gradient reaches the compression parameters alone
                loss = loss + out.compression_loss / len(chunks)
                aux = out.compression_loss.detach().double() / len(chunks)  # () float64
                aux_sum = aux if aux_sum is None else aux_sum + aux
            scaler.scale(loss).backward()
        new_memories.append(out.memory)
        if alone:  # the model's mean and count are the step's (below)
            nll_sum = out.loss.detach()  # () float32
            n_total = getattr(out, "tokens", None)  # () int64
            n_total = (y != IGNORE_INDEX).sum() if n_total is None else n_total
            continue
        chunk_sum = out.loss.detach().double() * n  # () float64: the chunk's NLL sum, as the host summed it before
        nll_sum = chunk_sum if nll_sum is None else nll_sum + chunk_sum
    if alone:
        # One chunk in one process: the step's loss and count are the model's mean and its int64 count
        # (``LMOutput.tokens``), which ``read_stats`` widens to float64 as it reads them: 6 kernels fewer than
        # counting again and the sum below, the same number, (loss * n) / n being exact in float64 for n < 2**29 (a
        # step that scores no label logs the model's 0 where the sum gave 0 / 0).
        loss, count = nll_sum, n_total
    else:
        sums = [nll_sum, n_total.double()] + ([] if aux_sum is None else [aux_sum])
        # Stacked for one all-reduce between processes; alone, nothing to reduce (one kernel fewer).
        nll_sum, count, *aux = all_reduce_sum_tensor(torch.stack(sums), info).unbind() if info.enabled else sums
        aux_sum = aux[0] / info.world_size if aux else None  # every process's mean over equal shares
        loss = nll_sum / count
    # A non-finite loss is found when the trainer reads the step (``read_stats``), which stops the run before
    # anything is saved; fp16's gradient scaler skips the update of a step with non-finite gradients itself.
    scaler.unscale_(optimizer)
    # Each parameter group is clipped on its own: the compression function's (Rae et al. 2020, its own loss) does
    # not change the main model's clipping. One group (every model without one) is the global norm, as before.
    norms = [parallel.clip_grad_norm(list(g["params"]), clip if clip > 0 else math.inf) for g in optimizer.param_groups]
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(loss, count, lr, norms[0], aux_sum), new_memories


def batches(it: OrderedIterator) -> Iterator[Batch]:
    """Segments forever, epoch after epoch."""
    while True:
        yield from it


# -- the time budget ------------------------------------------------------------------------------------

CALIBRATION_STEPS = 20
"""Steps timed before a time budget first sets the schedule's horizon; it is re-estimated at every log
interval after that, from the whole run's rate (validations and checkpoints included)."""


def time_horizon(step: int, steps_timed: int, elapsed: float, budget: float, max_steps: int,
                 info: DistInfo) -> int:
    """The last step that fits in the time budget at the rate measured so far (``steps_timed`` steps in
    ``elapsed`` seconds, evaluations and checkpoints included, so no safety factor is needed).

    Every rank gets the same answer (the smallest), so distributed runs stop together.
    """
    rate = steps_timed / max(elapsed, 1e-9)
    horizon = min(max_steps, step + int(rate * max(budget - elapsed, 0.0)))
    if info.enabled:
        horizon = int(all_reduce_min([float(horizon)], info)[0])
    return max(horizon, step + 1)


# -- checks at the boundary -----------------------------------------------------------------------------

def check_run(cfg: RunConfig, info: DistInfo) -> None:
    """The invariants that depend on where the run happens (device, process count), checked once, before
    any data is read: the config checks the rest when it is built."""
    t = cfg.train
    if t.batch_size % (info.world_size * t.grad_accum):
        raise ValueError(f"train.batch_size={t.batch_size} must be divisible by {info.world_size} process(es) x "
                         f"grad_accum={t.grad_accum} (each accumulation chunk of each process takes an equal share "
                         f"of the streams); use a multiple of {info.world_size * t.grad_accum}")
    if cfg.eval.batch_size % info.world_size:
        raise ValueError(f"eval.batch_size={cfg.eval.batch_size} must be divisible by the {info.world_size} "
                         "processes; use a multiple of the process count")
    if t.precision == "fp16" and info.device.type != "cuda":
        raise ValueError(f"train.precision='fp16' needs CUDA (its gradient scaler is CUDA-only) and the run is on "
                         f"{info.device}; use --train.precision bf16 (or fp32) on CPU")
    if t.graphs in ("step", "model") and t.parallel == "fsdp":
        raise ValueError(f"train.graphs={t.graphs!r} runs the model at static shapes through CUDA graphs, which "
                         "FSDP's per-step collectives do not fit; use --train.parallel ddp, or --train.graphs off")
    precision = resolve_precision(t.precision, info.device)  # 'auto': bf16 on a GPU that has it, else fp32
    if precision == "bf16" and info.device.type == "cpu" and cpu_has_native_bf16() is False:
        log.warning("train.precision=bf16: this CPU has no bf16 matrix instructions (AVX512_BF16 or AMX), so "
                    "bf16 autocast makes its matmuls many times slower than fp32; --train.precision fp32 is faster")


def eval_settings(*, tgt_len: int, context: Context, batch_size: int, batches: int,
                  model: ModelConfig | None = None) -> str:
    """The settings a figure was computed in, printed beside it: without them two figures look comparable
    when they are not (``Context.describe``; ``model``: a compressive model's second memory named too)."""
    return (f"tgt_len {tgt_len}, {context.describe(model=model)}, {batch_size} streams, "
            f"{f'first {batches} segments' if batches else 'whole split'}")


# -- wiring ---------------------------------------------------------------------------------------------

def train(cfg: RunConfig, *, resume: str | Path | None = None, corpus: Corpus | None = None,
          overwrite: bool = False, init: TransformerXL | None = None) -> TrainResult:
    """Train as ``cfg`` says (or continue the run in ``resume``); validate, checkpoint, test, sample.

    A fresh run refuses a run directory that already holds files unless ``overwrite`` (which deletes
    them); one process at a time may train into a directory (``txl.rundir``). SIGTERM and SIGINT stop
    the run at the next step boundary with a checkpoint and raise ``txl.signals.Stopped``.
    ``init``: a model whose weights the run starts from (fine-tuning, ``txl.finetune``); its parameters
    must have the shapes ``cfg.model`` gives.
    """
    from txl.data.corpora import load_run_corpus

    info = init_distributed(cfg.train.device)
    lock, peer_died = None, False
    try:
        check_run(cfg, info)
        lock = _open_run_dir(Path(cfg.train.out_dir), resume is not None, overwrite, info)
        if info.is_main:
            elastic.record_job(Path(cfg.train.out_dir))  # a torchrun restart of this job continues it (txl.elastic)
        corpus = corpus or load_run_corpus(cfg.data)
        cfg = cfg.replace(model=cfg.model.replace(vocab_size=corpus.vocab_size))
        check_splits_fit(cfg, corpus)
        with matmul_precision(info.device, tf32=cfg.train.tf32):  # for this run only, restored after
            with StopRequest() as stop, naming_dead_peers(info):  # named while a SIGTERM cannot cut it short
                result = Trainer(cfg, corpus, info, stop, init=init).run(resume)
            barrier(info)  # no process tears the group down while another still tests, plots or samples
            return result
    except PeerDied:
        peer_died = True  # no orderly teardown with a peer gone: exit at once, before torchrun's SIGTERM
        raise
    finally:
        if not peer_died:
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
        check_split_fits(split, len(tokens), batch_size=e.batch_size, tgt_len=tgt_len, flag=flag)


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


def _check_finite(model: torch.nn.Module, valid_loss: float | None, step: int, latest: Path | None,
                  info: DistInfo, capacity: bool = False) -> None:
    """Raise rather than checkpoint diverged weights or a non-finite validation loss: ``latest`` must
    always name weights a run can resume from (and latest.json stays valid JSON, which has no NaN)."""
    bad = None
    if valid_loss is not None and not math.isfinite(valid_loss):
        bad = f"the validation loss is {valid_loss}"
    elif not parallel.all_finite(model, info):
        bad = "the weights hold non-finite values"
    if bad is not None:
        raise TrainingError(f"{bad} at step {step}: training diverged and this step was not saved. "
                            f"{_divergence_advice(latest, 'resume from it or restart', capacity)}")


def _divergence_advice(latest: Path | None, then: str, capacity: bool = False) -> str:
    """What to do after a divergence: resume from the last good checkpoint, or (none yet) start again. ``capacity``:
    the adaptive softmax scores fixed rows per tail cluster, where a label beyond them has a NaN loss (a batch they
    were not sized for: the run sizes them for its own, ``txl.evaluate.fit_capacity``), so that is named too."""
    fix = "Lower --optim.lr, add --optim.warmup_steps, or use --train.precision fp32"
    overflow = (". A NaN can also be a tail cluster of the adaptive softmax holding more labels than its "
                "cluster_rows='capacity' rows: use --compute.cluster_rows all, or selected eagerly" if capacity else "")
    if latest is None:
        return (f"No checkpoint was written yet, so there is nothing to resume: {fix[0].lower()}{fix[1:]}, and "
                f"start again with the same command and --overwrite{overflow}")
    return f"The last good checkpoint is {latest}. {fix}, then {then}{overflow}"


class Trainer:
    """The run's stateful parts and the loop that drives them; holds no state a checkpoint forgets."""

    def __init__(self, cfg: RunConfig, corpus: Corpus, info: DistInfo, stop: StopRequest | None = None, *,
                 init: TransformerXL | None = None) -> None:
        t = cfg.train
        self.stop = stop or StopRequest()  # SIGTERM/SIGINT seen: checkpoint and stop at the step boundary
        self.saved_at: int | None = None  # the step of the last checkpoint this run wrote
        self.cfg, self.corpus, self.info, self.out = cfg, corpus, info, Path(t.out_dir)
        torch.manual_seed(t.seed)
        self.model = TransformerXL(cfg.model, cfg.compute).to(info.device)
        if init is not None:  # fine-tuning: the pretrained weights, every process the same
            self.model.load_state_dict(init.state_dict())
        torch.manual_seed(t.seed + info.rank)  # same weights everywhere, different dropout per process
        self.precision = resolve_precision(t.precision, info.device)
        # DDP wraps the model; FSDP shards it in place, so the optimiser is built after, on the shards.
        self.ddp: torch.nn.Module = parallel.wrap(self.model, info, parallel=t.parallel, precision=self.precision,
                                                  activation_checkpointing=t.activation_checkpointing)
        self.sharded = t.parallel == "fsdp"  # DCP checkpoints, at any process count (one process included)
        graphs, why = graphs_mode(cfg, info.device, info.world_size)
        if why is not None:  # one line: what runs instead, and why
            (log.info if t.graphs == "auto" else log.warning)(
                "train.graphs=%s: the whole step is not captured (%s); training with graphs %r", t.graphs, why,
                graphs)
        capturable = graphs == "step" and info.device.type == "cuda"  # its step counts and rate read on the device
        self.optimizer = build_optimizer(self.model, cfg.optim, capturable=capturable)
        self.scaler = torch.amp.GradScaler(info.device.type, enabled=self.precision == "fp16")
        if info.device.type != "cpu":  # the model checks ids on the host only: check the split before it moves
            check_token_ids(corpus.train, cfg.model.vocab_size)
        it = OrderedIterator(corpus.train, batch_size=t.batch_size, tgt_len=t.tgt_len, ext_len=cfg.model.ext_len,
                             var_len=t.var_len, seed=t.seed, rank=info.rank, world_size=info.world_size,
                             device=info.device)
        self.state = TrainState(iterator=it, device=info.device, grad_accum=t.grad_accum)
        # 'capacity' rows (the adaptive softmax's static shapes) sized from every batch the run reads, before anything
        # is compiled or captured: training's in grad_accum chunks, validation's and the test's (txl.evaluate).
        static = t.compile or cfg.eval.compile or graphs != "off"
        fit_capacity(self.model, it, t.grad_accum, static=static)
        for split, tgt in ((corpus.valid, t.tgt_len), (corpus.test, cfg.eval.segment_len(t.tgt_len))):
            fit_capacity(self.model, eval_iterator(split, batch_size=cfg.eval.batch_size, tgt_len=tgt,
                                                   world_size=info.world_size), static=static)
        self.capacity = sizes_capacity(self.model, static)
        self.checkpointer = ckpt.Checkpointer(self.out, keep_last=t.keep_last)
        # DDP first, then compile: dynamo splits at buckets. graphs: static shapes, CUDA graphs (txl.graphs).
        self.step_model = StaticSteps(self.ddp) if graphs == "model" else compile_model(self.ddp, t.compile)
        self.step_graph = None  # the whole step as one CUDA graph (txl.step_graph), built by its first step
        if graphs == "step":
            self.step_graph = StepGraph(self.model, self.optimizer, self.scaler, step=train_step, clip=cfg.optim.clip,
                                        precision=self.precision, info=info, loss_positions=t.loss_positions)
        self.pending: list[StepStats] = []  # steps whose figures are still on the device (settle)

    # -- the stateful parts -------------------------------------------------------------------------

    def parts(self) -> dict[str, Any]:
        """Every part besides the model, under the checkpoint's fixed keys (ckpt.STATE_PARTS). A sharded
        run's optimiser state lives in the checkpoint's DCP shards beside the model's (ckpt.SHARDED)."""
        optimizer = ckpt.SHARDED if self.sharded else with_float_lr(self.optimizer.state_dict())
        return {"optimizer": optimizer, "scaler": self.scaler.state_dict(), "train": self.state.state_dict()}

    def save(self, *, best: bool, info: dict[str, Any] | None = None) -> None:
        self.settle()  # the state's token count complete, and nothing saved after a non-finite loss
        _check_finite(self.model, (info or {}).get("valid_loss"), self.state.step,
                      self.checkpointer.latest() if self.info.is_main else None, self.info, self.capacity)
        parts = self.parts()
        local = parts["train"].pop("local")
        if self.info.enabled:  # every process's RNG states and memories, in rank order
            import torch.distributed as dist
            ranks: list[Any] = [None] * self.info.world_size
            dist.all_gather_object(ranks, local)
        else:
            ranks = [local]
        parts["train"]["ranks"] = ranks
        if self.sharded:  # collective: every process writes its shards of the weights and optimiser state
            model_state, optim_state = parallel.state_dicts(self.model, self.optimizer)
            try:
                self.checkpointer.save_sharded(self.state.step, shards={"model": model_state, "optimizer": optim_state},
                                               config=self.cfg.model, run=self.cfg, tokenizer=self.corpus.tokenizer,
                                               parts=parts, best=best, info=info, dist_info=self.info)
            except ckpt.CheckpointError as err:
                raise TrainingError(str(err)) from err
        elif self.info.is_main:
            try:
                self.checkpointer.save(self.state.step, model=self.model, run=self.cfg, tokenizer=self.corpus.tokenizer,
                                       parts=parts, best=best, info=info)
            except (KeyboardInterrupt, ckpt.CheckpointError) as err:
                # A second Ctrl-C cut the write (torch's and safetensors' writers may turn it into their own
                # error): an interruption, not a full disk. The previous checkpoint is intact.
                if isinstance(err, KeyboardInterrupt) or self.stop.forced:
                    raise Interrupted(getattr(err, "signal", signal.SIGINT),
                                      f"the write of checkpoint step {self.state.step}") from None
                raise TrainingError(str(err)) from err
        barrier(self.info)
        self.saved_at = self.state.step

    def stop_here(self, metrics: MetricsLog) -> None:
        """At a step boundary: on SIGTERM/SIGINT (seen by any process) checkpoint this step and stop."""
        if not any_true(self.stop.requested, self.info):
            return
        sig = self.stop.signal or signal.SIGTERM  # a process that saw none follows the one that did
        if self.saved_at != self.state.step:  # the same on every process: save() is collective
            self.save(best=False)
        metrics.close()
        raise Stopped(sig, self.state.step, self.checkpointer.latest() if self.info.is_main else None, self.out)

    def restore(self, resume: str | Path) -> None:
        if ckpt.is_sharded(ckpt.find_checkpoint(resume)):
            return self.restore_sharded(resume)
        if parallel.is_sharded(self.model):
            raise ValueError(f"{resume} is a DDP (unsharded) checkpoint; resume it with --train.parallel ddp, or "
                             "in one process, whose next checkpoints are then sharded ones that FSDP resumes")
        loaded = ckpt.load(resume, device=self.info.device)
        ckpt.check_tokenizer(loaded.path, self.corpus.tokenizer)
        if loaded.model.config.to_dict() | {"mem_len": 0} != self.model.config.to_dict() | {"mem_len": 0}:
            raise ValueError(f"the checkpoint {loaded.path} was trained with another model config; resume with "
                             "the run's own config (txl train --resume DIR takes it from the checkpoint)")
        self.model.load_state_dict(loaded.model.state_dict())
        self.optimizer.load_state_dict(loaded.state["optimizer"])
        self.scaler.load_state_dict(loaded.state["scaler"])
        self.state.load_state_dict(loaded.state["train"], rank=self.info.rank, world_size=self.info.world_size)
        self.saved_at = self.state.step  # this step's checkpoint exists: a signal now need not write it again
        log.info("resumed from %s at step %d", loaded.path, self.state.step)

    def restore_sharded(self, resume: str | Path) -> None:
        """Resume from a DCP checkpoint written at any process count: each process reads the parts of the
        saved shards its own shards cover (torch.distributed.checkpoint reshards), and its streams' memory."""
        path = ckpt.find_checkpoint(resume)
        ckpt.check_tokenizer(path, self.corpus.tokenizer)
        config, state = ckpt.read_model_config(path), ckpt.read_train_state(path)
        if config.to_dict() | {"mem_len": 0} != self.model.config.to_dict() | {"mem_len": 0}:
            raise ValueError(f"the checkpoint {path} was trained with another model config; resume with "
                             "the run's own config (txl train --resume DIR takes it from the checkpoint)")
        if not self.sharded:
            raise ValueError(f"{path} is a sharded (--train.parallel fsdp) checkpoint; resume it with "
                             "--train.parallel fsdp, or consolidate it first: txl consolidate RUN_DIR -o MODEL_DIR")
        model_state, optim_state = parallel.state_dicts(self.model, self.optimizer)
        ckpt.load_shards(path, {"model": model_state, "optimizer": optim_state}, self.info)
        parallel.load_state_dicts(self.model, self.optimizer, model_state, optim_state)
        self.scaler.load_state_dict(state["scaler"])
        self.state.load_state_dict(state["train"], rank=self.info.rank, world_size=self.info.world_size)
        log.info("resumed from %s at step %d (sharded, %d process(es))", path, self.state.step, self.info.world_size)

    # -- evaluation ---------------------------------------------------------------------------------

    @property
    def show_progress(self) -> bool:
        """Whether this process draws progress bars (train.progress, and only the main process)."""
        return self.cfg.train.progress and self.info.is_main

    def validate(self, max_batches: int) -> tuple[EvalResult, str]:
        """The validation loss in the training context; periodic checks read the first ``max_batches``
        segments, the same ones every time, so their losses compare like with like."""
        t, e = self.cfg.train, self.cfg.eval
        with segment_progress(self.show_progress, "valid") as on_segment, parallel.gathered(self.model):
            result = evaluate(self.model, self.corpus.valid, metric=self.corpus.metric, batch_size=e.batch_size,
                              tgt_len=t.tgt_len, max_batches=max_batches, precision=self.precision, info=self.info,
                              compile=e.compile, graphs=e.graphs, on_segment=on_segment)
        return result, eval_settings(tgt_len=t.tgt_len, context=self.cfg.model.context(), batch_size=e.batch_size,
                                     batches=max_batches, model=self.cfg.model)

    def test(self) -> tuple[EvalResult, str]:
        """The test loss in the evaluation context (cfg.eval; None fields: as in training)."""
        e = self.cfg.eval
        tgt, context = e.segment_len(self.cfg.train.tgt_len), e.context(self.cfg.model)
        with segment_progress(self.show_progress, "test") as on_segment, parallel.gathered(self.model):
            result = evaluate(self.model, self.corpus.test, metric=self.corpus.metric, batch_size=e.batch_size,
                              tgt_len=tgt, context=context, precision=self.precision, info=self.info,
                              compile=e.compile, graphs=e.graphs, on_segment=on_segment)
        return result, eval_settings(tgt_len=tgt, context=context, batch_size=e.batch_size, batches=0,
                                     model=self.cfg.model)

    def decide_best(self, metrics: MetricsLog) -> tuple[bool, EvalResult]:
        """Validate on the decision tokens and say whether this is the best model so far.

        Every best-checkpoint decision reads the same validation tokens (the first train.eval_batches
        segments, or the whole split when it is 0): comparing a partial estimate with a full one would
        keep a worse checkpoint whenever the two estimates disagree.
        """
        self.settle()  # a diverged step stops the run before its evaluation
        valid, settings = self.validate(self.cfg.train.eval_batches)
        metrics.write("valid", self.state.step, loss=valid.loss, **{self.corpus.metric: valid.value},
                      batches=self.cfg.train.eval_batches)
        log.info("step %d: valid %s (%s)", self.state.step, valid.describe(), settings)
        best = valid.loss < self.state.best_valid
        if best:
            self.state.best_valid = valid.loss
        return best, valid

    # -- the loop -----------------------------------------------------------------------------------

    def run(self, resume: str | Path | None = None) -> TrainResult:
        cfg, t, info, state = self.cfg, self.cfg.train, self.info, self.state
        if resume is not None:
            if info.is_main:
                remove_partial(self.out / CKPT_DIR)  # what a killed writer left (start() does it afresh)
                remove_partial(self.out)
            self.restore(resume)
            end = state.horizon or t.max_steps
            if state.step >= end:  # nothing to train: say so, rather than appear to start a run that only evaluates
                log.info("the run had finished (step %d of %d): nothing to train; its best checkpoint is evaluated "
                         "again (--max-steps N trains on to step N)", state.step, end)
        elif info.is_main:
            self.checkpointer.start(cfg)
        metrics = MetricsLog(self.out, enabled=info.is_main, tensorboard=t.tensorboard,
                             resume_step=state.step if resume is not None else None)
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("model: %s parameters; corpus %s: %s train tokens, vocab %s, metric %s; %d process(es) on %s",
                 f"{n_params:,}", self.corpus.name, f"{len(self.corpus.train):,}", self.corpus.vocab_size,
                 self.corpus.metric, info.world_size, info.device)
        bar = ProgressBar(total=state.horizon or t.max_steps, initial=state.step, enabled=t.progress and info.is_main)
        try:
            stopped = self.loop(metrics, bar)
        finally:
            bar.close()
        return self.finish(metrics, stopped)

    def loop(self, metrics: MetricsLog, bar: ProgressBar) -> str:
        cfg, t, info, state = self.cfg, self.cfg.train, self.info, self.state
        budget = t.minutes * 60
        start, start_step = time.perf_counter(), state.step
        tokens_then, time_since = state.tokens, start
        stream = batches(state.iterator)
        while state.step < (state.horizon or t.max_steps):
            elapsed = time.perf_counter() - start
            if budget and not info.enabled and elapsed > budget:  # safety net; DDP stops at the horizon
                return "time"
            batch = next(stream)
            if batch.start == 0:  # a new epoch: streams restart, nothing to remember
                state.reset_memories()
            lr = lr_at(state.step, cfg.optim, state.horizon or t.max_steps)
            if self.step_graph is not None:  # one replay of the captured step
                stats, state.memories = self.step_graph(batch, state.memories, lr=lr)
            else:
                stats, state.memories = train_step(self.step_model, self.optimizer, self.scaler, batch, state.memories,
                                                   lr=lr, clip=cfg.optim.clip, precision=self.precision, info=info,
                                                   loss_positions=t.loss_positions)
            state.step += 1
            self.pending.append(stats)  # read at the next log interval, evaluation or checkpoint (settle)
            done = state.step - start_step
            if budget and done >= CALIBRATION_STEPS and (done == CALIBRATION_STEPS or state.step % t.log_interval == 0):
                # Re-estimated from the whole run so far, so slow phases (validation, a busy machine) count.
                state.horizon = time_horizon(state.step, done, time.perf_counter() - start, budget, t.max_steps, info)
                bar.set_total(state.horizon)
            if state.step % t.log_interval == 0 or state.step == t.max_steps:
                stats = self.settle()
                now = time.perf_counter()
                tok_s = (state.tokens - tokens_then) / max(now - time_since, 1e-9)
                tokens_then, time_since = state.tokens, now
                extra = {} if stats.compression_loss is None else {"compression_loss": stats.compression_loss}
                metrics.write("train", state.step, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                              tokens=state.tokens, tokens_per_s=tok_s, **extra)
                bar.set_postfix({"loss": f"{stats.loss:.3f}",
                                 self.corpus.metric: f"{metric_value(stats.loss, self.corpus.metric):.3f}",
                                 "tok/s": f"{tok_s:,.0f}"})
            bar.update(1)
            last = state.step >= (state.horizon or t.max_steps)
            is_eval = bool(t.eval_interval) and state.step % t.eval_interval == 0 and not last
            if is_eval:
                best, valid = self.decide_best(metrics)
                self.save(best=best, info={"valid_loss": valid.loss})
            elif t.ckpt_interval and state.step % t.ckpt_interval == 0 and not last:
                self.save(best=False)
            self.stop_here(metrics)
        self.settle()
        if state.horizon and state.horizon < t.max_steps:
            return "time"
        return "max_steps"

    def settle(self) -> StepStats | None:
        """Read the steps run since the last read (one host sync for all of them): stop at the first non-finite
        loss, add their tokens to the state; the last step's figures (None: none pending)."""
        steps, self.pending = read_stats(self.pending), []
        first = self.state.step - len(steps) + 1
        for i, stats in enumerate(steps):
            if not math.isfinite(stats.loss):
                latest = self.checkpointer.latest() if self.info.is_main else None
                raise TrainingError(f"loss is {stats.loss} at step {first + i}: training stopped. "
                                    f"{_divergence_advice(latest, 'resume or restart', self.capacity)}")
        self.state.tokens += sum(stats.tokens for stats in steps)
        return steps[-1] if steps else None

    def finish(self, metrics: MetricsLog, stopped: str) -> TrainResult:
        """The last best decision and checkpoint, then the full validation and the test of the best model.

        A run resumed from its final checkpoint (it had finished, or was stopped during its final
        evaluation) skips the decision already made; its valid_full and test rows are written once. After
        the final checkpoint nothing is left to save, so a signal stops the evaluation at once
        (``StopRequest.at_once``, rc 128 + N) and the message names the intact checkpoint.
        """
        t, info, state = self.cfg.train, self.info, self.state
        if self.saved_at != state.step:
            best, decided = self.decide_best(metrics)
            self.save(best=best, info={"valid_loss": decided.loss})
            self.stop_here(metrics)  # a signal during the final validation: its checkpoint is written, skip the test
        else:
            best = ckpt.best(self.out) == ckpt.latest(self.out)
        self.stop.at_once("the final evaluation (training is complete; resuming runs the evaluation again)")
        best_dir = self.checkpointer.best() if info.is_main else None
        if not best:
            self.load_best()
        best_step = int(best_dir.name.rsplit("_", 1)[1]) if best_dir is not None else state.step
        valid, valid_ctx = self.validate(0)
        metrics.write("valid_full", best_step, loss=valid.loss, **{self.corpus.metric: valid.value})
        log.debug("valid of the best checkpoint (step %d): %s (%s)", best_step, valid.describe(), valid_ctx)
        test, test_ctx = self.test()
        metrics.write("test", best_step, loss=test.loss, **{self.corpus.metric: test.value})
        log.debug("test of the best checkpoint (step %d): %s (%s)", best_step, test.describe(), test_ctx)
        metrics.close()
        sample = None
        whole = contextlib.ExitStack()  # FSDP: every process gathers the weights, then the main one samples
        whole.enter_context(parallel.gathered(self.model))
        if info.is_main:
            if t.plot:
                try:
                    plot_learning_curve(metrics.path, self.out / PLOT_FILE, self.corpus.metric)
                except Exception as err:  # noqa: BLE001 - a picture must not fail a finished run
                    log.warning("learning-curve plot not written: %s; the run's results are complete (%s)",
                                err, metrics.path)
            if t.sample_tokens:
                mem = self.cfg.eval.context(self.cfg.model).mem_len
                sample = _sample(self.model, self.corpus, t.sample_tokens, self.cfg.sample, mem_len=mem, seed=t.seed)
        whole.close()
        return TrainResult(out_dir=self.out, steps=state.step, valid=valid, test=test, sample=sample, stopped=stopped,
                           valid_context=valid_ctx, test_context=test_ctx, best_step=best_step)

    def load_best(self) -> None:
        """Load the best checkpoint's weights (by validation loss) for the final evaluation, on every process."""
        best = ckpt.best(self.out)
        if best is None or not best.is_dir():
            return
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

            weights = get_model_state_dict(self.model)
            ckpt.load_shards(best, {"model": weights}, self.info)
            set_model_state_dict(self.model, weights)
            log.info("evaluating the best checkpoint %s", best)
            return
        weights, source = read_state(best)
        load_weights(self.model, weights, source=source)
        self.model.to(self.info.device)
        log.info("evaluating the best checkpoint %s", best)


@torch.no_grad()
def _sample(model: TransformerXL, corpus: Corpus, n: int, settings: SampleConfig, *, mem_len: int, seed: int,
            prompt_len: int = 64) -> str:
    """A continuation of the test split's first tokens drawn with the run's ``[sample]`` settings (its seed,
    else ``seed``; its memory, else ``mem_len``), prompt and continuation marked."""
    from txl.generation import generate

    device = next(model.parameters()).device
    prompt = torch.as_tensor(np.asarray(corpus.test[:prompt_len], dtype=np.int64), device=device)[None]  # (1, P)
    s = settings
    new = generate(model, prompt, max_new_tokens=n, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                   repetition_penalty=s.repetition_penalty, seed=seed if s.seed is None else s.seed,
                   mem_len=mem_len if s.mem_len is None else s.mem_len, stop_strings=s.stop,
                   decode=corpus.tokenizer.decode if s.stop else None)  # (1, <= n)
    decode = corpus.tokenizer.decode
    return decode(prompt[0].tolist()) + " >>> " + decode([t for t in new[0].tolist() if t >= 0])
