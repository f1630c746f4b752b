"""The Transformer-XL model: pure PyTorch modules, no I/O.

Modules, bottom up (each imports only torch, ``txl.config`` and the modules listed before it):

* ``plan``: every choice that depends on the device type, in one table, and ``resolve(config, device_type)``;
* ``positions``: the sinusoid R, distances, ``rel_shift``, ``Positions``, the attention mask;
* ``memory``: the memory of cached hidden states, built, truncated and detached in one place;
* ``dropout``: ``nn.Dropout`` and the cheaper 16-bit mask;
* ``kernels``: attention kernels on tensors (fused, recomputing backward, realigned positional scores);
* ``kv_cache``: the key/value cache and its projections;
* ``attention``: the paper's reference attention and one class per encoding, with its traits;
* ``adaptive``: adaptive input embedding and log-softmax;
* ``transformer``: the layers and the language model.
"""

from txl.model.attention import Attention, encoding
from txl.model.kv_cache import KVCache
from txl.model.memory import Memory, update_memory, zeros_memory
from txl.model.positions import attention_mask
from txl.model.transformer import LMOutput, TransformerXL

__all__ = ["Attention", "KVCache", "LMOutput", "Memory", "TransformerXL", "attention_mask", "encoding",
           "update_memory", "zeros_memory"]
