"""Training checkpoints: composed from stateful parts, written atomically, found by `latest` and `best`.

A run directory looks like::

    run.json                        the RunConfig
    metrics.jsonl                   one JSON row per log / validation / test
    latest.json, best.json          pointers: {"step": N, "path": "checkpoints/step_00000N", ...}
    checkpoints/step_00000N/
        config.json, model.safetensors   the model (txl.from_pretrained reads this directory)
        run.json                         the RunConfig of the run
        tokenizer/                       the corpus's tokenizer (checked on resume and eval)
        train_state.pt                   every other stateful part, under fixed keys (STATE_PARTS)

A ``--train.parallel fsdp`` run writes sharded checkpoints: the same directory, with the weights and the
optimiser state in ``dcp/`` (torch.distributed.checkpoint: each process writes its own shards, plus one
``.metadata`` file) instead of ``model.safetensors`` and ``train_state.pt``'s optimiser part. All
processes write into the temporary directory the main process made; the main process renames it into
place once every shard is written, so a sharded checkpoint too is complete or absent. DCP reshards on
load: the checkpoint resumes at any process count, and ``txl.from_pretrained`` (so ``txl eval``,
``txl export``, ``txl serve``) reads its weights whole; ``txl consolidate`` writes a plain model directory.
(Several machines: the run directory must be on a file system they all see, as torchtitan's.)

The checkpoint is the dict of the run's stateful parts (torchtitan's pattern): the model, and in
``train_state.pt`` the optimiser, the gradient scaler and the ``TrainState`` (step, tokens, schedule,
iterator, and each process's RNG states and memories), each the ``state_dict()`` of its owner. Each
checkpoint is written into a temporary directory and renamed into place (``txl.fileio.atomic_write``);
the pointers are rewritten atomically afterwards. A crash or a full disk mid-write leaves the previous
checkpoint and pointers as they were.

Public API: ``Checkpointer`` (writes a run's checkpoints), ``latest(run_dir)``, ``best(run_dir)``,
``find_checkpoint(path, which)`` and ``load(path)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from txl.config import MACHINE_KEY, SECTIONS, ComputeConfig, RunConfig
from txl.data.tokenizer import read_meta, save_tokenizer
from txl.fileio import atomic_write, fsync_dir, fsync_tree, remove_partial, write_json
from txl.model import TransformerXL
from txl.pretrained import FORMAT, from_pretrained, save_pretrained
from txl.rundir import CKPT_DIR, best, find_checkpoint, latest  # latest/best: txl.checkpoint's documented API
from txl.runtime import machine_record

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
RUN_FILE = "run.json"
TOKENIZER_DIR = "tokenizer"
STATE_PARTS = ("optimizer", "scaler", "train")
"""The fixed keys of train_state.pt, one per stateful part besides the model."""
SHARD_DIR = "dcp"
SHARDED = {"format": "dcp", "path": SHARD_DIR}
"""train_state.pt's "optimizer" part in a sharded checkpoint: the state is in the DCP shards."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""


@dataclass
class Checkpoint:
    path: Path
    model: TransformerXL
    run: RunConfig
    state: dict[str, Any] | None
    """The stateful parts (train_state.pt, keys STATE_PARTS), or None when only the model was asked for."""


class _KeepWriteError(io.RawIOBase):
    """A file that remembers the OSError of a failed write: torch.save turns it into a RuntimeError
    whose text ("enforce fail at inline_container.cc ... unexpected pos") does not say the disk is full."""

    def __init__(self, f: io.RawIOBase) -> None:
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int | None:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise


def _write_state(path: Path, state: dict[str, Any]) -> None:
    with open(path, "wb", buffering=0) as f:
        out = _KeepWriteError(f)
        try:
            torch.save(state, out)
        except RuntimeError as err:
            if out.error is not None:
                raise out.error from err
            raise


def _write_error(err: BaseException) -> str:
    """A short reason for a failed write: the OS's words for its error. safetensors raises
    SafetensorError (not an OSError) with the OS error number in its text ("os error 28")."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    text = str(err)
    code = re.search(r"os error (\d+)|code: (\d+)", text)
    if code:
        return os.strerror(int(code.group(1) or code.group(2)))
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(err).__name__}: {first[:200]}"


class Checkpointer:
    """Writes the checkpoints of one run directory: one per call to ``save``, the last ``keep_last`` kept
    (and always the ones ``latest`` and ``best`` point at)."""

    def __init__(self, run_dir: str | os.PathLike, *, keep_last: int) -> None:
        self.run_dir, self.keep_last = Path(run_dir), keep_last

    def start(self, run: RunConfig) -> None:
        """Create the run directory with its run.json; remove what a killed writer left behind."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The CPU kernels, threads and versions beside the config: figures reproduce per CPU kind (README).
        write_json(self.run_dir / RUN_FILE, {**run.to_dict(), MACHINE_KEY: machine_record()})
        remove_partial(self.run_dir / CKPT_DIR)

    def latest(self) -> Path | None:
        return latest(self.run_dir)

    def best(self) -> Path | None:
        return best(self.run_dir)

    def save(self, step: int, *, model: TransformerXL, run: RunConfig, tokenizer: Any, parts: dict[str, Any],
             best: bool, info: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` from the model and the other ``parts`` (keys STATE_PARTS); point
        latest (and best) at it; prune old ones. Returns its path."""
        if set(parts) != set(STATE_PARTS):
            raise ValueError(f"a checkpoint holds the parts {STATE_PARTS}, got {sorted(parts)}")
        name = f"step_{step:08d}"
        final = self.run_dir / CKPT_DIR / name

        def write(tmp: Path) -> None:
            save_pretrained(model, tmp)
            write_json(tmp / RUN_FILE, run.to_dict())
            save_tokenizer(tokenizer, tmp / TOKENIZER_DIR)
            _write_state(tmp / STATE_FILE, parts)

        try:
            atomic_write(final, write, directory=True)
            pointer = {"step": step, "path": f"{CKPT_DIR}/{name}", **(info or {})}
            write_json(self.run_dir / "latest.json", pointer)
            if best:
                write_json(self.run_dir / "best.json", pointer)
        except Exception as err:  # torch's and safetensors' write errors are not OSError
            previous = self.latest()
            kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
            fix = "Free disk space and resume" if previous else "Free disk space and run again"
            how = f"txl train --resume {self.run_dir}" if previous else "the same command with --overwrite"
            raise CheckpointError(f"could not write checkpoint step {step} to {final} ({_write_error(err)}); "
                                  f"{kept}. {fix} with: {how}") from err
        self.prune()
        return final

    def save_sharded(self, step: int, *, shards: dict[str, Any], config: Any, run: RunConfig, tokenizer: Any,
                     parts: dict[str, Any], best: bool, dist_info: Any, info: dict[str, Any] | None = None) -> Path:
        """Collective: write checkpoint ``step`` with ``shards`` (a state dict of DTensors and tensors) through
        DCP, each process its own part, into one temporary directory; the main process adds the config,
        tokenizer and ``parts`` and renames it into place, then points latest (and best) at it."""
        import torch.distributed.checkpoint as dcp

        name = f"step_{step:08d}"
        final = self.run_dir / CKPT_DIR / name
        tmp, error = None, None
        if dist_info.is_main:
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp = final.parent / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"  # remove_partial's pattern
                os.mkdir(tmp, 0o777)
            except OSError as err:
                error = _write_error(err)
        tmp, error = _broadcast([None if tmp is None else str(tmp), error], dist_info)
        if error is None:
            try:
                with _single_process_quiet():
                    dcp.save(shards, storage_writer=dcp.FileSystemWriter(str(Path(tmp) / SHARD_DIR), sync_files=True),
                             no_dist=not dist_info.enabled)  # the writer fsyncs each shard before it returns
            except Exception as err:  # DCP gathers every process's failure and raises on all of them
                error = _write_error(err)
        if error is None and dist_info.is_main:
            try:
                tmp_dir = Path(tmp)
                write_json(tmp_dir / "config.json", {"format": FORMAT, "version": 1, "model": config.to_dict()})
                write_json(tmp_dir / RUN_FILE, run.to_dict())
                save_tokenizer(tokenizer, tmp_dir / TOKENIZER_DIR)
                _write_state(tmp_dir / STATE_FILE, parts)
                fsync_tree(tmp_dir)
                old = None
                if final.exists():  # the same step written again (a resumed run's last step): as atomic_write does
                    old = final.parent / f".tmp-old-{name}-{os.getpid()}"
                    os.replace(final, old)
                os.replace(tmp_dir, final)
                fsync_dir(final.parent)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
                pointer = {"step": step, "path": f"{CKPT_DIR}/{name}", **(info or {})}
                write_json(self.run_dir / "latest.json", pointer)
                if best:
                    write_json(self.run_dir / "best.json", pointer)
            except Exception as err:
                error = _write_error(err)
        if error is not None and dist_info.is_main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        (error,) = _broadcast([error], dist_info)
        if error is not None:
            previous = self.latest()
            kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
            how = f"resume with: txl train --resume {self.run_dir}" if previous else "run again"
            raise CheckpointError(f"could not write checkpoint step {step} to {final} ({error}); {kept}. Free disk "
                                  f"space and {how}")
        if dist_info.is_main:
            self.prune()
        return final

    def prune(self) -> None:
        """Delete step checkpoints beyond the last ``keep_last``, never the best or latest one."""
        keep = {p for p in (self.best(), self.latest()) if p}
        steps = sorted(p for p in (self.run_dir / CKPT_DIR).glob("step_*") if p.is_dir())
        for path in steps[:-self.keep_last]:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)


# The fields every run.json has held since its first version (txl of 2026-11-22). A saved run.json lacking
# one of them is damaged, and filling it from the defaults would change what the run is (a model field) or
# the figure it reports (an eval field): it is refused. A run.json written before a later field existed
# (model.attn_impl, dropout_impl, recompute_attention; train.compile, tf32, loss_positions; eval.compile;
# the [sample] section; any field added since) lacks only such fields: that documented older version loads,
# each missing field taking its default, which by the rule for adding a field reproduces the older behaviour
# (except the [compute] section, ModelConfig's how-fields until issue 45 (txl.config.MOVED_FIELDS: a saved model
# section's move there), whose defaults changed since: such a run resumes with today's kernels, which compute the
# same model; its dropout masks are other draws of the same distribution).
FIRST_RUN_FIELDS = {
    "data": ("corpus", "data_dir", "level", "cache_dir", "max_bytes"),
    "model": ("vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "d_embed", "cutoffs", "div_val",
              "tie_weight", "tie_projs", "dropout", "dropatt", "mem_len", "ext_len", "clamp_len", "same_length",
              "same_length_style", "attn_type", "learned_positions", "untie_r", "pre_ln", "layer_norm_eps",
              "init_std", "proj_init_std"),
    "optim": ("optimizer", "lr", "min_lr", "schedule", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
              "clip"),
    "train": ("out_dir", "max_steps", "minutes", "batch_size", "grad_accum", "tgt_len", "seed", "precision",
              "device", "eval_interval", "eval_batches", "ckpt_interval", "keep_last", "log_interval",
              "tensorboard", "plot", "progress", "sample_tokens"),
    "eval": ("batch_size", "tgt_len", "mem_len", "clamp_len", "same_length", "ext_len"),
}


def check_saved_run(data: object, file: Path) -> dict[str, Any]:
    """``data`` (a run.json's content) if it holds every field a saved run has always held; else a
    ValueError naming the missing ones (see FIRST_RUN_FIELDS)."""
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a table of config sections; the checkpoint is corrupt")
    known = {f.name for kind in (SECTIONS[n] for n in FIRST_RUN_FIELDS) for f in dataclasses.fields(kind)}
    missing = [f"{section}.{name}" for section, names in FIRST_RUN_FIELDS.items() for name in names
               if name in known and not (isinstance(data.get(section), dict) and name in data[section])]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(f"{file} lacks the field(s) {shown}, which every saved run holds: the file is damaged and "
                         "its defaults would change the run or its figures. Restore it from another checkpoint of "
                         "the run (checkpoints/*/run.json, or run.json in the run directory)")
    return data


def _broadcast(values: list[Any], dist_info: Any) -> list[Any]:
    """The main process's ``values`` (small Python objects) on every process."""
    if dist_info.enabled:
        import torch.distributed as dist

        dist.broadcast_object_list(values, src=0)
    return values


def is_sharded(path: Path) -> bool:
    """Whether a checkpoint directory holds DCP shards (a --train.parallel fsdp run's)."""
    return (Path(path) / SHARD_DIR / ".metadata").is_file()


def load_shards(path: Path, state: dict[str, Any], dist_info: Any) -> None:
    """Collective: fill ``state`` (this process's tensors and DTensors, any sharding) from the checkpoint's
    DCP shards; DCP reads for each process the parts of the saved shards its own cover."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(Path(path) / SHARD_DIR)), no_dist=not dist_info.enabled)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it is "assuming the intent is to save/load in a single process": one process is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_model_config(path: Path) -> Any:
    """The ModelConfig in a checkpoint's config.json."""
    from txl.config import ModelConfig

    file = Path(path) / "config.json"
    try:
        return ModelConfig.from_dict(json.loads(file.read_text(encoding="utf-8"))["model"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{file} is corrupt ({type(err).__name__}); resume from an earlier checkpoint") from None


def read_train_state(path: Path) -> dict[str, Any]:
    """The stateful parts besides the model (train_state.pt, keys STATE_PARTS); corrupt files raise a
    ValueError that names the file."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: the checkpoint has weights but no training state")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # advice for a training state, not for a weights file
        ckpt = Path(path)
        raise ValueError(f"{file} holds Python objects other than tensors and numbers, and txl never unpickles "
                         "those (unpickling can run code): txl did not write it. Resume from another checkpoint "
                         f"under {ckpt.parent}, or start a new run from this checkpoint's weights (its "
                         f"model.safetensors holds tensors only) with txl train --init-from {ckpt}") from None
    except Exception as err:
        raise ValueError(f"{file} is corrupt or truncated ({type(err).__name__}); resume from an earlier "
                         "checkpoint under checkpoints/") from None
    state = _from_flat(state)
    missing = [k for k in STATE_PARTS if k not in state]
    if missing:
        raise ValueError(f"{file} lacks the part(s) {missing} (written by an older txl?); its weights still "
                         f"load with txl.from_pretrained, but training cannot resume from it")
    return state


def read_run(path: Path) -> RunConfig:
    file = path / RUN_FILE
    try:
        return RunConfig.from_dict(check_saved_run(json.loads(file.read_text(encoding="utf-8")), file))
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} not found: {path} is not a training checkpoint") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err}); the checkpoint is corrupt") from None


def load(path: str | os.PathLike, *, which: str = "latest", with_state: bool = True,
         device: torch.device | str = "cpu", compute: ComputeConfig | None = None) -> Checkpoint:
    """Load a checkpoint's model, run config and (optionally) training state; corrupt files raise
    a ValueError that names the file. The model computes as ``compute`` says (None: as the run did)."""
    ckpt = find_checkpoint(path, which)
    run = read_run(ckpt)
    model = from_pretrained(ckpt, device=device, compute=run.compute if compute is None else compute)
    state = read_train_state(ckpt) if with_state else None
    return Checkpoint(path=ckpt, model=model, run=run, state=state)


load_checkpoint = load
"""The former name of ``load``, kept while callers move over."""


def _from_flat(state: dict[str, Any]) -> dict[str, Any]:
    """A train_state.pt written before the parts had their own keys (one flat dict, per-rank lists of RNG
    states and memories) in today's layout, so runs started earlier still resume."""
    if "train" in state or "step" not in state:
        return state
    ranks = [{"rng": rng, "memories": mem} for rng, mem in zip(state["rng"], state["memories"])]
    train = {"step": state["step"], "tokens": state["tokens"], "best_valid": state["best_valid"],
             "horizon": state.get("horizon", 0), "iterator": state["iterator"], "ranks": ranks}
    return {"optimizer": state["optimizer"], "scaler": state["scaler"], "train": train}


def check_tokenizer(ckpt: Path, tokenizer: Any) -> None:
    """Raise unless ``tokenizer`` has the vocabulary the checkpoint was trained with."""
    saved = read_meta(ckpt / TOKENIZER_DIR)
    if saved is None:
        return  # a plain model directory: only the vocabulary size can be checked (by the model)
    vocab_sha = getattr(getattr(tokenizer, "vocab", None), "sha256", lambda: None)()
    if saved.get("vocab_size") != tokenizer.vocab_size or saved.get("spec", {}).get("level") != \
            tokenizer.spec.get("level") or (vocab_sha and saved.get("vocab_sha256") not in (None, vocab_sha)):
        raise ValueError(
            f"the corpus vocabulary ({tokenizer.spec.get('level')} level, {tokenizer.vocab_size} symbols) does "
            f"not match the checkpoint's ({saved.get('spec', {}).get('level')} level, {saved.get('vocab_size')} "
            f"symbols, {ckpt / TOKENIZER_DIR}); use the corpus and --data.level the model was trained with")
