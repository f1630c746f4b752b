"""The plain path: the whole Transformer-XL (Dai et al. 2019) in torch ops and ``nn`` modules, top to bottom.

Shape legend: B batch, T segment length, M memory length, K = M + T, d d_model, H heads, D head width,
N = B*T tokens, V vocabulary, e_i the embedding width of cluster i.

``ComputeConfig.attn_impl='reference'`` runs this module: no custom autograd Function, no device test, no cast of
its own. It equals the original (tests/test_parity_hf.py) and is the oracle every faster path is tested against
(tests/test_plain.py, tests/test_kernels.py).

One segment, as section 3.2 of the paper reads it:

    h^0 = dropout(adaptive_embedding(ids))
    h^l = layer_l(h^{l-1}, SG(memory^{l-1}))        l = 1 .. L
    memory'^{l-1} = the last mem_len rows of [memory^{l-1}; h^{l-1}]
    nll = -log p(label | dropout(h^L))             the adaptive softmax

and the layer (section 3.3, post-LN as the paper; pre-LN normalises what each sub-layer reads instead):

    q, k, v = W_q h, W_kE [m; h], W_v [m; h]
    A(i, j) = (q_i + u) . k_j  +  (q_i + v) . W_kR R(i - j)     (a) + (c),  (b) + (d)
    a = LayerNorm(h + dropout(W_o softmax(A / sqrt(D), masked) v))
    out = LayerNorm(a + dropout(W_2 dropout(relu(W_1 a))))

Each positional encoding (``ModelConfig.attn_type``, ``txl.model.attention``) supplies its own terms: the
positional scores (``position_scores``, before ``rel_shift``), the content bias (u), the rotation of q and k
(rotary), the positions added to the layer inputs (absolute ones).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import Context
from txl.labels import IGNORE_INDEX
from txl.model.compressive import split_state, window
from txl.model.kv_cache import KVCache
from txl.model.memory import Memory, memory_length, update_memory
from txl.model.positions import Positions, attention_mask, padding_mask, rel_shift


@dataclass
class LMOutput:
    """What one segment produces. Fields that were not asked for are None."""

    memory: Memory
    """The memory for the next segment: one (B, M', d) tensor per layer, gradient stopped (cmem_len > 0: then one
    (B, C', d) tensor per layer of the compressed memory, ``txl.model.compressive``)."""
    hidden: torch.Tensor
    """(B, T, d) final hidden states."""
    loss: torch.Tensor | None = None
    """Scalar mean NLL over the labels that are not IGNORE_INDEX (-100)."""
    nll: torch.Tensor | None = None
    """(B, T) per-token NLL; labels[:, t] is the target at position t; 0 where ignored."""
    tokens: torch.Tensor | None = None
    """() int64: how many labels are scored (not IGNORE_INDEX), what ``loss`` averages over."""
    log_probs: torch.Tensor | None = None
    """(B, T, V) log-probabilities of the next token (float32)."""
    kv_cache: KVCache | None = None
    """With ``kv_cache=`` in: the keys and values of exactly ``memory``'s rows, for the next call."""
    compression_loss: torch.Tensor | None = None
    """cmem_len > 0, 'conv', training: the attention-reconstruction loss (Rae et al. 2020), whose gradient reaches
    the compression parameters alone; add it to ``loss`` for backward."""


# -- the adaptive input (Baevski & Auli 2019) ------------------------------------------------------

def embed(emb: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T, d): each id looked up in its cluster's table, projected to d, scaled by sqrt(d)."""
    if len(emb.layers) == 1:  # div_val 1: one table for the whole vocabulary
        out = emb.layers[0](ids)  # (B, T, e)
        return (F.linear(out, emb.projs[0]) if len(emb.projs) else out) * emb.scale  # (B, T, d)
    out = 0.0
    for i, table in enumerate(emb.layers):  # cluster i holds ids lo <= id < hi, embedded e_i wide
        lo, hi = emb.bounds[i], emb.bounds[i + 1]
        mine = (ids >= lo) & (ids < hi)  # (B, T)
        rows = F.linear(table((ids - lo).clamp(0, hi - lo - 1)), emb.projs[i])  # (B, T, d)
        out = out + torch.where(mine[..., None], rows, 0.0)  # other clusters' ids add 0
    return out * emb.scale  # (B, T, d)


# -- the adaptive softmax (Grave et al. 2017) --------------------------------------------------------

def log_probs(sm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(N, d) -> (N, V) float32 log-probabilities. The head scores the shortlist and one logit per tail cluster;
    a tail token's log-probability is log p(cluster) + log p(token | cluster)."""
    bounds = sm.bounds
    if sm.div_val == 1:  # one (V, e) table: cluster i is its rows bounds[i]:bounds[i + 1]
        weights = [sm.layers[0].weight[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
        biases = [sm.layers[0].bias[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    else:
        weights = [layer.weight for layer in sm.layers]
        biases = [layer.bias for layer in sm.layers]
    if sm.n_clusters:  # the head also scores the tail clusters, cluster i by column shortlist + i - 1
        weights[0] = torch.cat([weights[0], sm.cluster_weight])  # (shortlist + C, e)
        biases[0] = torch.cat([biases[0], sm.cluster_bias])  # (shortlist + C,)
    parts = []
    for i, (weight, bias) in enumerate(zip(weights, biases)):
        h = torch.matmul(hidden, sm.projs[i]) if len(sm.projs) else hidden  # (N, e_i)
        logp = torch.log_softmax(F.linear(h, weight, bias), dim=-1, dtype=torch.float32)  # (N, V_i)
        if i == 0:
            head = logp
            parts.append(head[:, :sm.shortlist])
        else:
            parts.append(head[:, sm.shortlist + i - 1:sm.shortlist + i] + logp)  # (N, V_i)
    return torch.cat(parts, dim=1)  # (N, V)


def nll(sm: nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(N, d), (N,) -> (N,) negative log-likelihood; 0 where the target is IGNORE_INDEX."""
    ignored = target == IGNORE_INDEX
    picked = log_probs(sm, hidden).gather(1, target.masked_fill(ignored, 0)[:, None]).squeeze(1)  # (N,)
    return -picked.masked_fill(ignored, 0.0)


# -- one layer ------------------------------------------------------------------------------------

def attention(attn: nn.Module, x: torch.Tensor, memory: torch.Tensor | None, mask: torch.Tensor,
              pos: Positions | None, u: torch.Tensor | None, v: torch.Tensor | None, p: float, p_att: float,
              training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Relative multi-head attention over [memory; segment], residual, layer norm (section 3.3). x: (B, T, d);
    memory: (B, M, d) or None; mask: (T, K) or (B, 1, T, K), True where a key is hidden; pos: the layer's positions;
    u, v: the shared global biases (None: the layer's own, untie_r). Returns the layer's output (B, T, d), and the
    keys and values (B, K, H, D) of [memory; segment] (what a KVCache keeps)."""
    B, T, _ = x.shape
    H, D = attn.n_head, attn.d_head
    rows = x if memory is None else torch.cat([memory, x], dim=1)  # (B, K, d)
    K = rows.size(1)
    h = attn.norm(rows) if attn.pre_ln else rows  # pre-LN: the projections read LN(h)
    q, k, val = attn.qkv(h).view(B, K, 3, H, D).unbind(2)  # (B, K, H, D) each
    q = q[:, K - T:]  # (B, T, H, D): memory rows need keys and values alone
    qr, kr = attn.place(q, k)  # rotary: rotated by window index; the others: unchanged
    # (a) + (c): content, the query shifted by the global content bias u
    score = torch.einsum("bthd,bkhd->bhtk", qr + attn.content_bias(u), kr)  # (B, H, T, K)
    # (b) + (d): position, (q + v) . W_kR R by distance K-1-p, realigned to key index j by rel_shift
    position = attn.position_scores(qr, K, pos, v)  # (B, H, T, K) or None
    if position is not None:
        score = score + rel_shift(position)
    score = (score * attn.scale).masked_fill(mask, float("-inf"))  # no future key, nothing beyond the memory
    prob = F.dropout(torch.softmax(score, dim=-1), p_att, training)  # (B, H, T, K)
    out = torch.einsum("bhtk,bkhd->bthd", prob, val).reshape(B, T, H * D)  # (B, T, H*D)
    out = F.dropout(attn.out(out), p, training)  # (B, T, d)
    return (x + out if attn.pre_ln else attn.norm(x + out)), k, val


def feed_forward(ff: nn.Module, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Position-wise feed-forward, residual, layer norm: (B, T, d) -> (B, T, d)."""
    h = ff.norm(x) if ff.pre_ln else x
    out = F.dropout(ff.fc2(F.dropout(F.relu(ff.fc1(h)), p, training)), p, training)  # (B, T, d)
    return x + out if ff.pre_ln else ff.norm(x + out)


# -- the model: one segment, memory in and out ---------------------------------------------------------

def layer_positions(model: nn.Module, klen: int, clamp_len: int, dtype: torch.dtype, drop,
                    table: tuple[torch.Tensor, ...] = ()) -> list[Positions | None]:
    """Each layer's positions for K keys (``Attention.build_positions``), from the encoding's shared parameters."""
    shared = {name: getattr(model, name) for name in model.encoding.shared_parameters(model.config)}
    return model.encoding.build_positions(model.config, shared, klen, clamp_len, dtype=dtype,
                                          device=model.embed.layers[0].weight.device, drop=drop, table=table)


def segment_mask(T: int, M: int, ctx: Context, padding: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(T, K) bool, True where query i may not see key j (causal, same_length); (B, 1, T, K) with ``padding``."""
    mask = attention_mask(T, M, mem_len=ctx.mem_len, same_length=ctx.same_length, style=ctx.same_length_style,
                          device=device)  # (T, K)
    return mask if padding is None else padding_mask(mask, padding)  # (B, 1, T, K): no real query sees a pad


def read_memory(model: nn.Module, memory: Memory | None) -> tuple[Memory | None, Memory | None, list, int]:
    """The memory passed in -> (its own rows, the compressed ones (cmem_len > 0), per layer the M rows attended to
    before the segment with the gradient stopped (eq. (1): SG(memory)) or None, M)."""
    # Rae et al. 2020: a compressive model's layers attend over [compressed; memory; segment]
    own, compressed = (memory, None) if model.compressor is None else split_state(memory, model.config.n_layer)
    rows = window(own, compressed)
    M = memory_length(rows)
    return own, compressed, [m.detach() for m in rows] if M else [None] * model.config.n_layer, M


def add_absolute(x: torch.Tensor, memory: torch.Tensor | None, pos: Positions | None, M: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's segment rows (B, T, d) and memory rows (B, M, d) with an absolute encoding's positions added
    (``Positions.absolute``, (K, d): memory rows get the earlier ones); as they are for the other encodings."""
    if pos is None or pos.absolute is None:
        return x, memory
    return x + pos.absolute[M:], (None if memory is None else memory + pos.absolute[:M])


def next_state(model: nn.Module, out: LMOutput, own: Memory | None, compressed: Memory | None,
               hiddens: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor], *, ctx: Context,
               train: bool, kv: bool, version: int | None, table: tuple[torch.Tensor, ...] = (),
               buffers: list | None = None) -> None:
    """``out.memory`` for the next segment (section 3.2: the last mem_len layer inputs, or with cmem_len > 0 the
    compressed memory too and its loss), and with ``kv`` the KVCache of exactly its rows' keys and values."""
    if model.compressor is not None:
        out.memory, out.compression_loss = model.compressor.update(
            own, compressed, hiddens, mem_len=ctx.mem_len, layers=[layer.attn for layer in model.layers], train=train)
        if kv:
            out.kv_cache = model.compressor.next_cache(keys, values, buffers, own, out.memory, hiddens[0].size(1),
                                                       positions=table, weights_version=version)
        return
    out.memory = update_memory(own, hiddens, mem_len=ctx.mem_len, ext_len=ctx.ext_len)
    if kv:  # the keys and values of exactly the rows kept
        keep = functools.partial(update_memory, None, mem_len=ctx.mem_len, ext_len=ctx.ext_len)
        out.kv_cache = KVCache(keys=keep(keys), values=keep(values), positions=table, weights_version=version)


def predict(out: LMOutput, labels: torch.Tensor | None, return_log_probs: bool | None, score, log_prob) -> LMOutput:
    """The adaptive softmax on ``out.hidden``: the per-token NLL (``score(hidden, target)``) and loss of ``labels``,
    the log-probabilities (``log_prob(hidden)``) when asked, or when there are no labels."""
    B, T, _ = out.hidden.shape
    flat = out.hidden.reshape(B * T, -1)  # (N, d)
    if labels is not None:
        out.nll = score(flat, labels.reshape(-1)).view(B, T)  # (B, T)
        out.tokens = (labels != IGNORE_INDEX).sum()  # () int64
        out.loss = out.nll.sum() / out.tokens.clamp(min=1)
    if return_log_probs or (return_log_probs is None and labels is None):
        out.log_probs = log_prob(flat).view(B, T, -1)  # (B, T, V)
    return out


def forward(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None, memory: Memory | None, *,
            ctx: Context, return_log_probs: bool | None, kv_cache: KVCache | None,
            padding: torch.Tensor | None, weights_version: int | None) -> LMOutput:
    """``TransformerXL.forward`` on the plain path (its arguments checked there). A ``kv_cache`` passed in is not
    read (its keys are the memory's, computed again here); the one returned holds the new memory's."""
    c, train = model.config, model.training
    drop = functools.partial(F.dropout, p=c.dropout, training=train)
    T = input_ids.size(1)
    own, compressed, mems, M = read_memory(model, memory)
    mask = segment_mask(T, M, ctx, padding, input_ids.device)  # (T, K), or (B, 1, T, K) with padding
    h = drop(embed(model.embed, input_ids))  # (B, T, d)
    positions = layer_positions(model, M + T, ctx.clamp_len, h.dtype, drop)
    u, v = getattr(model, "u", None), getattr(model, "v", None)
    hiddens, keys, values = [], [], []
    for l, layer in enumerate(model.layers):
        hiddens.append(h)  # the memory keeps each layer's input
        x, mem = add_absolute(h, mems[l], positions[l], M)
        a, k, val = attention(layer.attn, x, mem, mask, positions[l], u, v, c.dropout, c.dropatt, train)
        h = feed_forward(layer.ff, a, c.dropout, train)  # (B, T, d)
        keys.append(k.detach())
        values.append(val.detach())
    out = LMOutput(memory=(), hidden=drop(h))  # (B, T, d)
    next_state(model, out, own, compressed, hiddens, keys, values, ctx=ctx, train=train and labels is not None,
               kv=kv_cache is not None, version=weights_version)
    return predict(out, labels, return_log_probs, functools.partial(nll, model.softmax),
                   functools.partial(log_probs, model.softmax))
