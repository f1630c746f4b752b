"""Conversion between our checkpoints and other layouts (Hugging Face `transfo-xl`, original PyTorch)."""

from txl.convert.hf import (
    config_from_hf,
    config_to_hf,
    is_hf_config,
    state_dict_from_hf,
    state_dict_to_hf,
)

__all__ = ["config_from_hf", "config_to_hf", "is_hf_config", "state_dict_from_hf", "state_dict_to_hf"]
