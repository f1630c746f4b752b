"""txl: Transformer-XL (Dai et al., 2019) language models in PyTorch.

The public names, and the submodules (``txl.generation``), are imported on first use (PEP 562), so ``txl --help``
and ``import txl.config`` do not pay for importing torch.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's constant, without importing typing: `txl`'s entry point imports this first
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"
"""The one version source: pyproject.toml reads it (setuptools dynamic version)."""

_EXPORTS = {
    "ComputeConfig": "txl.config", "Context": "txl.config", "ModelConfig": "txl.config",
    "KVCache": "txl.model", "LMOutput": "txl.model", "Memory": "txl.model", "TransformerXL": "txl.model",
    "from_pretrained": "txl.pretrained", "save_hf": "txl.pretrained", "save_pretrained": "txl.pretrained",
    "generate": "txl.generation", "generate_stream": "txl.generation",
    "iter_scores": "txl.score", "score_documents": "txl.score",
}
__all__ = ["ComputeConfig", "Context", "KVCache", "LMOutput", "Memory", "ModelConfig", "TransformerXL",
           "from_pretrained", "generate", "generate_stream", "iter_scores", "save_hf", "save_pretrained",
           "score_documents"]


def __getattr__(name: str) -> Any:
    import importlib
    import importlib.util

    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    # A submodule on first use too, so `import txl` then `txl.generation.FINISHED` works as the README writes it.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'txl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from txl.config import ComputeConfig, Context, ModelConfig
    from txl.generation import generate, generate_stream
    from txl.model import KVCache, LMOutput, Memory, TransformerXL
    from txl.pretrained import from_pretrained, save_hf, save_pretrained
    from txl.score import iter_scores, score_documents
