"""Where a model directory is: a model directory itself, a training run directory (its best checkpoint, else
its latest), or a Hugging Face Hub repo id such as ``transfo-xl/transfo-xl-wt103``, fetched into (or, with
``HF_HUB_OFFLINE=1``, read from) the Hub cache by ``huggingface_hub`` (the ``hub`` extra) at ``revision``.

Torch-free and below the model: the tokenizer files (``txl.data``) and the model loader (``txl.pretrained``)
both find their directory here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from txl.rundir import find_checkpoint

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"

# A Hub repo id: "name" or "org/name" of letters, digits, '-', '_', '.' (huggingface_hub's own rule).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Small files fetched with a whole snapshot: the config and any vocabulary or tokenizer files. The
# weights are fetched one file at a time below, so a repo holding both formats is not downloaded twice.
# vocab.pkl is what TransfoXLTokenizer.save_pretrained writes (and the published tokenizer map points at):
# it is read with txl's restricted unpickler, never with pickle (txl.data.tokenizer.hf_vocab).
_HUB_SMALL_FILES = ["*.json", "*.txt", "tokenizer/*", "vocab.pkl"]


def _hub():
    try:
        import huggingface_hub
    except ImportError as err:
        raise ImportError("loading a model by Hugging Face Hub repo id needs huggingface_hub: "
                          "pip install 'txl[hub]'") from err
    return huggingface_hub


def hub_snapshot(repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local snapshot directory of Hub repo ``repo_id`` at ``revision`` (default: main).

    Downloads what is missing into the Hub cache (``HF_HUB_CACHE``, or ``cache_dir``); with
    ``HF_HUB_OFFLINE=1`` only the cache is read. Fetches config.json, vocabulary/tokenizer files and one
    weights file: model.safetensors if the repo has it, else pytorch_model.bin.
    """
    hub = _hub()
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        folder = Path(hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                            allow_patterns=_HUB_SMALL_FILES))
        for name in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE):
            try:
                hub.hf_hub_download(repo_id, name, revision=revision, cache_dir=cache_dir)
                break
            except EntryNotFoundError:  # LocalEntryNotFoundError too: not in the cache while offline
                continue
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{repo_id} is not a local directory, and the Hugging Face Hub repo {where} is not in the Hub cache "
            "while downloads are off (HF_HUB_OFFLINE=1, or no connection); download it once online, or point "
            "HF_HUB_CACHE at a cache that holds it") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id} is neither a local directory nor a Hugging Face Hub repo (not found, "
                                "or private: log in with `huggingface-cli login`)") from None
    except OSError as err:  # RevisionNotFoundError, HTTP and connection errors
        raise FileNotFoundError(f"could not fetch the Hugging Face Hub repo {where}: "
                                f"{str(err).splitlines()[0]}") from None
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / LEGACY_WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"the Hugging Face Hub repo {where} has no {WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE} "
                                "(in the cache, when offline)")
    return folder


def resolve_model_dir(path: str | os.PathLike, *, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None, which: str = "best") -> Path:
    """A model directory from a model directory, a run directory (its ``which`` checkpoint, else the
    latest) or a Hugging Face Hub repo id (its snapshot in the Hub cache)."""
    p = Path(path)
    if p.is_dir():
        if (p / CONFIG_FILE).is_file():
            return p
        return find_checkpoint(p, which)
    if p.exists():
        raise FileNotFoundError(f"{p} is a file: pass a model directory (config.json + weights), a run "
                                "directory, or a Hugging Face Hub repo id")
    if not _REPO_ID.match(str(path)):
        raise FileNotFoundError(f"{p} does not exist (and is not a Hugging Face Hub repo id like "
                                "transfo-xl/transfo-xl-wt103)")
    try:
        _hub()
    except ImportError:  # a mistyped local path reads like a repo id: say both
        raise FileNotFoundError(f"{p} is not a local directory, and reading it as a Hugging Face Hub repo id needs "
                                "huggingface_hub: pip install 'txl[hub]'") from None
    return hub_snapshot(str(path), revision=revision, cache_dir=cache_dir)
