"""The Transformer-XL model: pure PyTorch modules, no I/O."""

from txl.model.kv_cache import KVCache
from txl.model.memory import Memory, update_memory, zeros_memory
from txl.model.transformer import LMOutput, TransformerXL, attention_mask

__all__ = ["KVCache", "LMOutput", "Memory", "TransformerXL", "attention_mask", "update_memory", "zeros_memory"]
