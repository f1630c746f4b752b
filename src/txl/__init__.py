"""txl: Transformer-XL (Dai et al., 2019) language models in PyTorch."""

from txl.config import ModelConfig

__all__ = ["ModelConfig"]
__version__ = "0.1.0"
