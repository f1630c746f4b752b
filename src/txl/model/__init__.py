"""The Transformer-XL model: pure PyTorch modules, no I/O.

Start with ``plain``: the whole model as the paper writes it, top to bottom, in torch ops and nn modules
(``ComputeConfig.attn_impl='reference'``). It is the oracle every other path is tested against.

Modules, bottom up (each imports only torch, ``txl.config``, ``txl.labels`` and the modules listed before it).
What the model is:

* ``positions``: the sinusoid R, distances, ``rel_shift``, ``Positions``, the attention mask;
* ``rotary``: rotary positions (queries and keys rotated by window index);
* ``memory``: the memory of cached hidden states, built, truncated and detached in one place;
* ``kv_cache``: the key/value cache of the memory rows, and the table of W_kR R it keeps;
* ``compressive``: the compressed memory (Rae et al. 2020): its function, update and reconstruction loss;
* ``plain``: the plain path, the whole model in one module, and ``LMOutput``.

How the default path computes it, behind the seam (each kept for a measured win, benchmarks/README.md):

* ``plan``: every choice that depends on the device type, in one table; ``resolve(compute, device_type)`` and the
  ``ComputePlan`` a model resolves once for the device it lives on;
* ``dropout``: ``nn.Dropout``'s distribution drawn from the gaps between drops (the CPU's sampler), or torch's;
* ``casting``: the layers' and the softmax's weights cast in one grouped op under autocast (``cast_weights``);
* ``kernels``: attention on tensors: the fused kernel with the positional scores as its bias; in training the
  probabilities kept (autograd) or recomputed in backward (``_RecomputedAttention``); the positional scores
  realigned in one strided pass (``_Realign``);
* ``attention``: one class per encoding, with its traits and positional terms (read by ``plain`` too), and the
  fast path's attention layer;
* ``adaptive``: adaptive input embedding and log-softmax (cluster rows and padding as the plan says);
* ``transformer``: the layers and the language model ``TransformerXL``: ``forward`` runs ``plain`` for
  'reference', else the fast path, which calls ``plain``'s pieces where it computes the same (the memory read,
  mask, positions, the memory and cache returned, the loss).
"""

from txl.model.attention import Attention, encoding
from txl.model.kv_cache import KVCache
from txl.model.memory import Memory, update_memory, zeros_memory
from txl.model.positions import attention_mask
from txl.model.transformer import LMOutput, TransformerXL

__all__ = ["Attention", "KVCache", "LMOutput", "Memory", "TransformerXL", "attention_mask", "encoding",
           "update_memory", "zeros_memory"]
