"""The Transformer-XL model: pure PyTorch modules, no I/O.

Start with ``plain``: the whole model as the paper writes it, top to bottom, in torch ops and nn modules
(``ComputeConfig.attn_impl='reference'``), the oracle every other path is tested against.

Modules, bottom up (each imports only torch, ``txl.config``, ``txl.labels`` and the modules listed before it).
What the model is: ``positions`` (the sinusoid R, distances, ``rel_shift``, the mask); ``rotary``; ``memory`` (built,
truncated and detached in one place); ``kv_cache``; ``compressive`` (Rae et al. 2020); ``plain`` (the plain path and
``LMOutput``).

How the default path computes it, behind the seam (each kept for a measured win, benchmarks/README.md):
``plan`` (every device-dependent choice, resolved once into a ``ComputePlan``); ``dropout`` (the CPU's gap sampler);
``casting`` (the weights cast in one grouped op under autocast); ``kernels`` (fused attention, ``_Realign``,
``_RecomputedAttention``); ``attention`` (one class per encoding, read by ``plain`` too, and the fast path's layer);
``adaptive`` (adaptive input and softmax); ``transformer`` (``TransformerXL``: ``forward`` runs ``plain`` for
'reference', else the fast path, which calls ``plain``'s pieces where it computes the same).
"""

from txl.model.attention import Attention, encoding
from txl.model.kv_cache import KVCache
from txl.model.memory import Memory, update_memory, zeros_memory
from txl.model.positions import attention_mask
from txl.model.transformer import LMOutput, TransformerXL

__all__ = ["Attention", "KVCache", "LMOutput", "Memory", "TransformerXL", "attention_mask", "encoding",
           "update_memory", "zeros_memory"]
