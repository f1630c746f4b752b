"""Training checkpoints: atomic directories, `latest` and `best` pointers, the last K kept.

A run directory looks like::

    run.json                        the RunConfig
    metrics.jsonl                   one JSON row per log / validation / test
    latest.json, best.json          pointers: {"step": N, "path": "checkpoints/step_00000N", ...}
    checkpoints/step_00000N/
        config.json, model.safetensors   the model (txl.from_pretrained reads this directory)
        run.json                         the RunConfig of the run
        tokenizer/                       the corpus's tokenizer (checked on resume and eval)
        train_state.pt                   optimiser, scaler, step, RNG states, iterator, memory

Each checkpoint is written into a temporary directory and renamed into place; the pointers are
rewritten atomically afterwards. A crash or a full disk mid-write leaves the previous checkpoint and
pointers as they were.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from txl.atomic import fsync_dir, fsync_tree
from txl.config import RunConfig
from txl.model import TransformerXL
from txl.pretrained import _atomic_write, from_pretrained, save_pretrained, unsafe_load_message

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
RUN_FILE = "run.json"
TOKENIZER_DIR = "tokenizer"
CKPT_DIR = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""


@dataclass
class Checkpoint:
    path: Path
    model: TransformerXL
    run: RunConfig
    state: dict[str, Any] | None
    """The training state (train_state.pt), or None when only the model was asked for."""


def write_json(path: Path, data: Any) -> None:
    """Atomically write strict JSON: a NaN or infinity raises ValueError instead of writing a bare
    ``NaN`` that JSON readers reject."""
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    _atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


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


def save_checkpoint(out_dir: str | os.PathLike, *, step: int, model: TransformerXL, run: RunConfig,
                    tokenizer: Any, state: dict[str, Any], best: bool, keep_last: int,
                    info: dict[str, Any] | None = None) -> Path:
    """Write checkpoint ``step``; point latest (and best) at it; prune old ones. Returns its path."""
    out = Path(out_dir)
    root = out / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_pretrained(model, tmp)
        write_json(tmp / RUN_FILE, run.to_dict())
        tokenizer.save(tmp / TOKENIZER_DIR)
        _write_state(tmp / STATE_FILE, state)
        fsync_tree(tmp)  # the data is on disk before the rename that publishes it
        old = root / f".tmp-old-{name}-{os.getpid()}"
        if final.exists():  # the same step again (a resumed run): move it aside, deleted once replaced
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(root)
        pointer = {"step": step, "path": f"{CKPT_DIR}/{name}", **(info or {})}
        write_json(out / "latest.json", pointer)
        if best:
            write_json(out / "best.json", pointer)
    except Exception as err:  # torch's and safetensors' write errors are not OSError
        shutil.rmtree(tmp, ignore_errors=True)
        previous = _pointer(out, "latest")
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        fix = "Free disk space and resume" if previous else "Free disk space and run again"
        how = f"txl train --resume {out}" if previous else "the same command with --overwrite"
        raise CheckpointError(f"could not write checkpoint step {step} to {final} ({_write_error(err)}); "
                              f"{kept}. {fix} with: {how}") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(out, keep_last)
    return final


def prune(out_dir: Path, keep_last: int) -> None:
    """Delete step checkpoints beyond the last ``keep_last``, never the best or latest one."""
    root = out_dir / CKPT_DIR
    keep = {p for p in (_pointer(out_dir, "best"), _pointer(out_dir, "latest")) if p}
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for path in steps[:-keep_last]:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)


def clean_partial(out_dir: str | os.PathLike) -> None:
    """Remove temporary directories and files a killed writer left behind."""
    for tmp in (Path(out_dir) / CKPT_DIR).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for tmp in Path(out_dir).glob(".*.tmp"):  # atomic_write's temporary files (pointers, run.json)
        tmp.unlink(missing_ok=True)


def _pointer(out_dir: Path, which: str) -> Path | None:
    file = out_dir / f"{which}.json"
    if not file.is_file():
        return None
    try:
        return out_dir / json.loads(file.read_text(encoding="utf-8"))["path"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{file} is corrupt; point it at a directory under {out_dir / CKPT_DIR}, or "
                         "delete it") from None


def find_checkpoint(path: str | os.PathLike, which: str = "latest") -> Path:
    """A checkpoint directory from itself or from a run directory (its ``which`` pointer: latest/best)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"{p} does not exist; pass a run directory (with latest.json) or a "
                                "checkpoint directory (with config.json)")
    for name in (which, "latest"):
        found = _pointer(p, name)
        if found is not None:
            if not found.is_dir():
                raise FileNotFoundError(f"{p / (name + '.json')} points at {found}, which is missing")
            return found
    raise FileNotFoundError(f"{p} holds no checkpoint (no latest.json, no config.json)")


def read_run(path: Path) -> RunConfig:
    file = path / RUN_FILE
    try:
        return RunConfig.from_dict(json.loads(file.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} not found: {path} is not a training checkpoint") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err}); the checkpoint is corrupt") from None


def load_checkpoint(path: str | os.PathLike, *, which: str = "latest", with_state: bool = True,
                    device: torch.device | str = "cpu") -> Checkpoint:
    """Load a checkpoint's model, run config and (optionally) training state; corrupt files raise
    a ValueError that names the file."""
    ckpt = find_checkpoint(path, which)
    run = read_run(ckpt)
    model = from_pretrained(ckpt, device=device)
    state = None
    if with_state:
        file = ckpt / STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: the checkpoint has weights but no training state")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(unsafe_load_message(file, err)) from None
        except Exception as err:
            raise ValueError(f"{file} is corrupt or truncated ({type(err).__name__}); resume from an earlier "
                             "checkpoint under checkpoints/") from None
    return Checkpoint(path=ckpt, model=model, run=run, state=state)


def check_tokenizer(ckpt: Path, tokenizer: Any) -> None:
    """Raise unless ``tokenizer`` has the vocabulary the checkpoint was trained with."""
    from txl.data.tokenizer import read_meta

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
