"""Saving and loading models: our format, and Hugging Face `transfo-xl` directories.

Our format is a directory with ``config.json`` ({"format": "txl", "model": <ModelConfig>}) and
``model.safetensors`` (tied weights stored once). Nothing is ever unpickled: a legacy ``.bin`` is read
with ``torch.load(weights_only=True)``. Loading is strict: every tensor in the file must be used, every
parameter must be given, and every shape must match the config, or a ValueError says which.

Where a model directory is asked for, three things are accepted (:func:`resolve_model_dir`): a model
directory itself, a training run directory (its best checkpoint, else its latest), or a Hugging Face Hub
repo id such as ``transfo-xl/transfo-xl-wt103``, fetched into (or, with ``HF_HUB_OFFLINE=1``, read
from) the Hub cache by ``huggingface_hub`` (the ``hub`` extra) at ``revision``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from txl.config import ComputeConfig, ModelConfig
from txl.convert.hf import (
    ClusterOrder,
    config_from_hf,
    config_to_hf,
    is_hf_config,
    state_dict_from_hf,
    state_dict_to_hf,
)
from txl.fileio import atomic_write
from txl.hub import (  # noqa: F401 - where a model directory is found: txl.hub, re-exported here
    _HUB_SMALL_FILES,
    CONFIG_FILE,
    LEGACY_WEIGHTS_FILE,
    WEIGHTS_FILE,
    hub_snapshot,
    resolve_model_dir,
)
from txl.model import TransformerXL

FORMAT = "txl"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as err:  # the core needs only torch and numpy
        raise ImportError("reading and writing checkpoints needs safetensors: pip install 'txl[io]'") from err
    return safetensors.torch


def tied_keys(model: TransformerXL) -> dict[str, str]:
    """Parameter names that alias another parameter -> the name stored in checkpoints."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def load_weights(model: TransformerXL, state: dict[str, torch.Tensor], *, source: str) -> TransformerXL:
    """Load ``state`` into ``model`` strictly, assigning the tensors (works on a meta-device model)."""
    expected = model.state_dict(keep_vars=True)
    aliases = tied_keys(model)
    state = dict(state)
    for alias, stored in aliases.items():
        if alias in state and stored in state and not torch.equal(state[alias], state[stored]):
            raise ValueError(f"{source}: {alias} differs from {stored}, but the config ties them "
                             "(tie_weight / tie_projs); fix the config to untie them")
        state.pop(alias, None)
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state) - set(aliases))
    if unexpected or missing:
        raise ValueError(f"{source}: weights and config disagree: missing {missing[:6]}, unexpected "
                         f"{unexpected[:6]} (is config.json the one saved with these weights?)")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)} but the config needs "
                             f"{tuple(expected[name].shape)} (is config.json the one saved with these weights?)")
    dtype = next(iter(expected.values())).dtype
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: a checkpoint directory needs config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from None


def unsafe_load_message(path: Path, err: Exception) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed, without torch's advice to retry with
    ``weights_only=False`` (which would run whatever code the file names)."""
    import pickle

    if isinstance(err, pickle.UnpicklingError):
        return (f"{path} holds Python objects other than tensors and numbers, and txl never unpickles those "
                "(unpickling can run code); it was not written by txl: convert it to model.safetensors with a "
                "tool you trust, or use a checkpoint txl wrote")
    return f"{path} is corrupt or truncated ({type(err).__name__}); restore it or use an earlier checkpoint"


def read_sharded_state(shards: Path) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded (torch.distributed.checkpoint) checkpoint's ``dcp/`` directory, read in
    this one process whatever the number that wrote it (no process group needed or used)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(shards))
    try:
        meta = reader.read_metadata()
    except Exception as err:
        raise ValueError(f"{shards / '.metadata'} is corrupt or truncated ({type(err).__name__}); use an earlier "
                         "checkpoint") from None
    state = {key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in meta.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}  # (saved as {"model": ...})
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state


def read_state(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of a checkpoint directory (safetensors preferred; a sharded checkpoint's DCP shards read
    whole) and the file they came from."""
    if (directory / "dcp" / ".metadata").is_file() and not (directory / WEIGHTS_FILE).is_file():
        return read_sharded_state(directory / "dcp"), str(directory / "dcp")
    st = directory / WEIGHTS_FILE
    legacy = directory / LEGACY_WEIGHTS_FILE
    if st.exists():
        try:
            return _safetensors().load_file(str(st)), str(st)
        except Exception as err:  # safetensors raises its own error type for damaged files
            raise ValueError(f"{st} is corrupt or truncated ({err}); restore it or use an earlier "
                             "checkpoint") from None
    if legacy.exists():
        try:
            state = torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(unsafe_load_message(legacy, err)) from None
        return state, str(legacy)
    raise FileNotFoundError(f"no {WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE} in {directory}")


def from_pretrained(path: str | os.PathLike, *, cluster_order: ClusterOrder = "hf",
                    device: torch.device | str = "cpu", revision: str | None = None,
                    cache_dir: str | os.PathLike | None = None, compute: ComputeConfig | None = None) -> TransformerXL:
    """Load a model (eval mode) from our checkpoint directory, a Hugging Face `transfo-xl` one, a training
    run directory (best checkpoint, else latest) or a Hub repo id at ``revision`` (cached in ``cache_dir``,
    default the Hub cache), computed as ``compute`` says (None: the defaults; the checkpoint stores only what the
    model is, so it loads under any compute config).

    ``cluster_order="original_pytorch"`` reorders the adaptive-softmax cluster rows of a checkpoint
    converted from the original PyTorch code.
    """
    directory = resolve_model_dir(path, revision=revision, cache_dir=cache_dir)
    file = directory / CONFIG_FILE
    data = _read_json(file)
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object; the checkpoint's config is "
                         "corrupt: restore it from a copy or save the model again")
    state, source = read_state(directory)
    if is_hf_config(data):
        config = config_from_hf(data)
        state = state_dict_from_hf(state, cluster_order=cluster_order)
    elif data.get("format") == FORMAT:
        if not isinstance(data.get("model"), dict):
            raise ValueError(f"{file}: \"model\" is {json.dumps(data.get('model'))}, not an object of "
                             "ModelConfig fields; the checkpoint's config is corrupt: restore it from a copy or save "
                             "the model again")
        try:
            config = ModelConfig.from_dict(data["model"])
        except (TypeError, ValueError) as err:  # the config's own validation names the field
            raise ValueError(f"{file}: {err}") from None
    else:
        raise ValueError(f"{directory / CONFIG_FILE} is neither a txl config (format: 'txl') nor a Hugging "
                         "Face transfo-xl config (model_type: 'transfo-xl')")
    with torch.device("meta"):  # no time spent initialising weights that are about to be replaced
        model = TransformerXL(config, compute)
    load_weights(model, state, source=source)
    return model.to(device).eval()


def save_pretrained(model: TransformerXL, path: str | os.PathLike) -> Path:
    """Write config.json and model.safetensors (tied weights once), each atomically."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    aliases = tied_keys(model)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in aliases}
    atomic_write(directory / WEIGHTS_FILE, lambda tmp: _safetensors().save_file(state, tmp))
    config = {"format": FORMAT, "version": 1, "model": model.config.to_dict()}
    atomic_write(directory / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2)))
    return directory


def save_hf(model: TransformerXL, path: str | os.PathLike) -> Path:
    """Export to the Hugging Face `transfo-xl` layout (config.json + model.safetensors)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = config_to_hf(model.config)
    state = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    hf_state = state_dict_to_hf(state)
    atomic_write(directory / WEIGHTS_FILE,
                  lambda tmp: _safetensors().save_file(hf_state, tmp, metadata={"format": "pt"}))
    atomic_write(directory / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(hf_config, indent=2)))
    return directory
