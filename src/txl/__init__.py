"""txl: Transformer-XL (Dai et al., 2019) language models in PyTorch."""

from txl.config import Context, ModelConfig
from txl.model import KVCache, LMOutput, Memory, TransformerXL

__all__ = ["Context", "KVCache", "LMOutput", "Memory", "ModelConfig", "TransformerXL"]
__version__ = "0.1.0"

from txl.pretrained import from_pretrained, save_hf, save_pretrained  # noqa: E402

__all__ += ["from_pretrained", "save_hf", "save_pretrained"]

from txl.generate import generate, generate_stream  # noqa: E402

__all__ += ["generate", "generate_stream"]

from txl.score import iter_scores, score_documents  # noqa: E402

__all__ += ["iter_scores", "score_documents"]
