"""Adaptive input embeddings (Baevski & Auli 2019) and the projected adaptive log-softmax (Grave et al. 2017).

Shape legend: N tokens (flattened B*T), V vocabulary, d d_model (= d_proj), e_i the embedding width of
cluster i (d_embed // div_val**i), C number of tail clusters.

The vocabulary, most frequent first, is split at ``cutoffs`` into a head (shortlist) and C tail
clusters. The head softmax scores the shortlist plus one logit per tail cluster; a tail token's
log-probability is log p(cluster) + log p(token | cluster). Tail cluster i (1-based) is scored by head
column shortlist + i - 1, the order of Hugging Face and the TensorFlow original (the original PyTorch
code reads column -i, i.e. the cluster rows reversed; the converter reorders such checkpoints).

Which rows a tail cluster computes is ``ComputeConfig.cluster_rows``: only its own tokens ('selected', found with
``nonzero``: the least work, a host sync per cluster), or every token with the others masked out ('all':
static shapes and no sync, for torch.compile and CUDA graphs); 'auto' picks 'selected' eagerly on the CPU and
'all' elsewhere (``txl.model.plan``). A token's cluster is a sum of comparisons with the cutoffs, so no tensor of
the cutoffs is made per call and the compiler sees plain elementwise ops.

Under autocast the output weights are cast once per call and sliced after (tied to the input embedding,
they are one (V, e) table: per-slice casts would copy it piece by piece, and the head's cat again); with
``ComputeConfig.softmax_pad`` each matmul's width is padded with zero rows scored -inf. Where
``ComputeConfig.cast_weights`` groups, one copy kernel casts and lays out all of them, the head's cluster rows and
the padding included (``txl.model.casting.cast_rows``), and one casts their gradients back.

Selected rows: a tail cluster that no token of the batch falls in is skipped, so its parameters get no gradient.
``every_cluster = True`` (set by ``txl.parallel.shard``) runs it anyway on no rows: its gradient is then zeros.
FSDP needs that: every process must reduce-scatter the same gradients, whichever clusters its shard of the
batch used (torch 2.13's ``set_reduce_scatter_unused_params`` does the same inside FSDP; this works with every
FSDP2 release).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig
from txl.labels import IGNORE_INDEX
from txl.model import casting
from txl.model.kernels import compute_dtype


def cluster_bounds(config: ModelConfig) -> list[int]:
    """[0, c_1, ..., c_C, V]: cluster i holds ids bounds[i] <= id < bounds[i + 1]."""
    return [0, *config.cutoffs, config.vocab_size]


def cluster_widths(config: ModelConfig) -> list[int]:
    """Embedding width of each cluster: d_embed for all when div_val = 1, else d_embed // div_val**i."""
    n = config.n_clusters + 1
    if config.div_val == 1:
        return [config.d_embed] * n
    return [config.d_embed // config.div_val ** i for i in range(n)]


def rows_mode(rows: str) -> str:
    """The planned ``cluster_rows`` ('selected' or 'all'), except under torch.compile: always 'all' there
    (``nonzero``'s data-dependent shape would break the graph)."""
    return "all" if torch.compiler.is_compiling() else rows


def cluster_of(target: torch.Tensor, cutoffs: list[int]) -> torch.Tensor:
    """(N,) ids -> (N,) int64 cluster index (0 = head): how many cutoffs each id reaches.

    Comparisons with Python ints, not ``bucketize`` against a tensor of the cutoffs: no tensor is made per call,
    and the compiler sees plain elementwise ops (its fused bucketize kernel failed in Triton on a GPU).
    """
    cluster = (target >= cutoffs[0]).long()  # (N,)
    for c in cutoffs[1:]:
        cluster += target >= c
    return cluster


class AdaptiveEmbedding(nn.Module):
    """Token ids (B, T) -> (B, T, d) embeddings, scaled by sqrt(d) as the original."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bounds = cluster_bounds(config)
        self.every_cluster = False  # see the module docstring
        self.rows = "selected"  # the model's plan sets it
        self.d_proj = config.d_model
        self.scale = config.d_model ** 0.5
        widths = cluster_widths(config)
        self.layers = nn.ModuleList()
        self.projs = nn.ParameterList()
        if config.div_val == 1:  # one table for the whole vocabulary, projected only if needed
            self.layers.append(nn.Embedding(config.vocab_size, config.d_embed))
            if config.d_embed != config.d_model:
                self.projs.append(nn.Parameter(torch.zeros(config.d_model, config.d_embed)))
        else:
            for i, width in enumerate(widths):
                self.layers.append(nn.Embedding(self.bounds[i + 1] - self.bounds[i], width))
                self.projs.append(nn.Parameter(torch.zeros(config.d_model, width)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.layers) == 1:
            emb = self.layers[0](ids)  # (B, T, e)
            if len(self.projs):
                emb = F.linear(emb, self.projs[0])  # (B, T, d)
            return emb * self.scale
        flat = ids.reshape(-1)  # (N,)
        if rows_mode(self.rows) == "all":
            # Shapes that do not depend on the ids (torch.compile, CUDA graphs, no host sync): every cluster
            # embeds every token (ids clamped into its range) and keeps the rows that are its own. Same values.
            out = None
            for i, layer in enumerate(self.layers):
                lo, hi = self.bounds[i], self.bounds[i + 1]
                emb = F.linear(layer((flat - lo).clamp(0, hi - lo - 1)), self.projs[i])  # (N, d)
                emb = torch.where(((flat >= lo) & (flat < hi))[:, None], emb, torch.zeros_like(emb))  # (N, d)
                out = emb if out is None else out + emb
            return out.view(*ids.shape, self.d_proj) * self.scale  # (B, T, d)
        parts = []
        for i, layer in enumerate(self.layers):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)  # (N_i,)
            if idx.numel() or self.every_cluster:
                parts.append((idx, F.linear(layer(flat[idx] - lo), self.projs[i])))  # (N_i, d)
        out = parts[0][1].new_zeros(flat.size(0), self.d_proj)  # (N, d)
        for idx, emb in parts:
            out = out.index_copy(0, idx, emb.to(out.dtype))
        return out.view(*ids.shape, self.d_proj) * self.scale  # (B, T, d)


Cluster = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""One output matmul of the softmax: weight (W_i, e_i), bias (W_i,), projection (d, e_i) or None; W_i >= the
cluster's width (V_i, or shortlist + C for the head) when padded, the extra rows zero and their bias -inf."""


class AdaptiveLogSoftmax(nn.Module):
    """Projected adaptive log-softmax; a plain (optionally projected) softmax when there are no cutoffs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bounds = cluster_bounds(config)
        self.every_cluster = False  # see the module docstring
        self.rows, self.pad = "selected", 1  # the model's plan sets them
        self.vocab_size = config.vocab_size
        self.shortlist = self.bounds[1]
        self.n_clusters = config.n_clusters
        self.div_val = config.div_val
        self.cast_weights = "auto"  # the model's plan sets it
        widths = cluster_widths(config)
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, config.d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.layers = nn.ModuleList()
        self.projs = nn.ParameterList()
        if config.div_val == 1:
            self.layers.append(nn.Linear(config.d_embed, config.vocab_size))
            if config.d_embed != config.d_model:  # one projection per cluster, as the original
                for _ in range(self.n_clusters + 1):
                    self.projs.append(nn.Parameter(torch.zeros(config.d_model, config.d_embed)))
        else:
            for i, width in enumerate(widths):
                self.layers.append(nn.Linear(width, self.bounds[i + 1] - self.bounds[i]))
                self.projs.append(nn.Parameter(torch.zeros(config.d_model, width)))

    def _clusters(self, dtype: torch.dtype, device: torch.device) -> list[Cluster]:
        """Every cluster's weight, bias and projection (0 = head), in ``dtype`` and padded (``softmax_pad``).

        Each parameter is cast once and sliced after: the tied (V, e) table of div_val 1 is one cast, not one
        per cluster slice (slices miss autocast's cache of cast weights), and the head's cat and the padding
        are made of the cast rows.
        """
        pad = self.pad
        params = self._cast_params()
        if self.cast_weights != "per_use" and not torch.compiler.is_compiling() and casting.groupable(params, dtype):
            return self._cast_clusters(params, dtype, pad)
        if self.div_val == 1:
            sizes = [hi - lo for lo, hi in zip(self.bounds, self.bounds[1:])]
            weight, bias = self.layers[0].weight.to(dtype), self.layers[0].bias.to(dtype)  # (V, e), (V,)
            # (V_i, e) views of one cast; split's backward is one cat, where a slice per cluster adds a zero-filled
            # (V, e) gradient each.
            weights, biases = (weight.split(sizes), bias.split(sizes)) if self.n_clusters else ([weight], [bias])
        else:
            weights = [layer.weight.to(dtype) for layer in self.layers]
            biases = [layer.bias.to(dtype) for layer in self.layers]
        out = []
        for i, (weight, bias) in enumerate(zip(weights, biases)):
            w_parts, b_parts = [weight], [bias]
            if i == 0 and self.n_clusters:  # the head also scores one logit per tail cluster
                w_parts.append(self.cluster_weight.to(dtype))
                b_parts.append(self.cluster_bias.to(dtype))
            extra = -sum(p.size(0) for p in w_parts) % pad
            if extra:  # zero rows scored -inf: exp(-inf) = 0 adds nothing to the softmax
                w_parts.append(weight.new_zeros(extra, weight.size(1)))
                b_parts.append(bias.new_full((extra,), float("-inf")))
            if len(w_parts) > 1:
                weight, bias = torch.cat(w_parts), torch.cat(b_parts)  # (W_i, e_i), (W_i,)
            proj = self.projs[i] if len(self.projs) else None
            out.append((weight, bias, None if proj is None else proj.to(dtype)))
        return out

    def _cast_params(self) -> list[torch.Tensor]:
        """The parameters ``_cast_clusters`` reads, in its order: each layer's weight and bias, the cluster weight
        and bias, the projections."""
        params = [p for layer in self.layers for p in (layer.weight, layer.bias)]
        if self.n_clusters:
            params += [self.cluster_weight, self.cluster_bias]
        return params + list(self.projs)

    def _cast_clusters(self, params: list[torch.Tensor], dtype: torch.dtype, pad: int) -> list[Cluster]:
        """``_clusters`` in one grouped op (``casting.cast_rows``), where ``ComputeConfig.cast_weights`` groups: every
        cluster's weight, bias and projection cast and laid out (the head's cluster rows after its shortlist, the
        padding after each) by one copy kernel, their gradients cast back by one. The same tensors."""
        n_layers, C = len(self.layers), self.n_clusters
        layouts, pads = [], []
        for i, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:])):
            w, b = (0, 1) if self.div_val == 1 else (2 * i, 2 * i + 1)  # the layer holding cluster i's rows
            first, last = (lo, hi) if self.div_val == 1 else (0, hi - lo)
            rows_w: list[casting.Piece] = [(w, first, last)]
            rows_b: list[casting.Piece] = [(b, first, last)]
            if i == 0 and C:  # the head also scores one logit per tail cluster
                rows_w.append((2 * n_layers, 0, C))
                rows_b.append((2 * n_layers + 1, 0, C))
            extra = -(last - first + (C if i == 0 else 0)) % pad
            if extra:  # zero rows scored -inf: exp(-inf) = 0 adds nothing to the softmax
                rows_w.append(extra)
                rows_b.append(extra)
            layouts += [rows_w, rows_b]
            pads += [0.0, float("-inf")]
        first_proj = 2 * n_layers + (2 if C else 0)
        layouts += [[(first_proj + j, 0, p.size(0))] for j, p in enumerate(self.projs)]
        pads += [0.0] * len(self.projs)
        cast = casting.cast_rows(params, layouts, pads, dtype)
        n = len(self.bounds) - 1
        projs = cast[2 * n:]
        return [(cast[2 * i], cast[2 * i + 1], projs[i] if projs else None) for i in range(n)]

    @staticmethod
    def _log_softmax(hidden: torch.Tensor, cluster: Cluster) -> torch.Tensor:
        """(N, d) hidden in the clusters' dtype -> (N, W_i) float32 log-probabilities (-inf in padded columns)."""
        weight, bias, proj = cluster
        if proj is not None:
            hidden = torch.matmul(hidden, proj)  # (N, e_i)
        logits = F.linear(hidden, weight, bias)  # (N, W_i)
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)

    def _prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, list[Cluster]]:
        """hidden cast once to the dtype the matmuls run in (autocast's, when on), and the clusters in it."""
        dtype = compute_dtype(hidden)
        return hidden.to(dtype), self._clusters(dtype, hidden.device)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N, V) log-probabilities over the whole vocabulary (float32)."""
        hidden, clusters = self._prepare(hidden)
        every = [self._log_softmax(hidden, cluster) for cluster in clusters]  # (N, W_i) each
        head = every[0]  # (N, W_0)
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            col, width = self.shortlist + i - 1, self.bounds[i + 1] - self.bounds[i]
            parts.append(head[:, col : col + 1] + every[i][:, :width])  # (N, V_i)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def nll(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(N, d), (N,) -> (N,) negative log-likelihood in token order; 0 where target is IGNORE_INDEX.

        Each tail cluster scores the tokens whose target falls in it (``cluster_rows``). The head's term is
        ``F.nll_loss`` (no reduction): -log p of the column, and 0 for an ignored target, in one kernel where a
        gather, the negation and two masks took four; an ignored id (-100) is in no cluster and scores no tail. A
        tail's log-probability is subtracted: -h - t is -(h + t) exactly (rounding is symmetric), as before.
        """
        hidden, clusters = self._prepare(hidden)
        head = self._log_softmax(hidden, clusters[0])  # (N, W_0)
        if not self.n_clusters:  # a plain softmax: the head alone
            return F.nll_loss(head, target, reduction="none", ignore_index=IGNORE_INDEX)  # (N,)
        cluster = cluster_of(target, self.bounds[1:-1])  # (N,): 0 for the head and for an ignored target
        # Which head column scores each token: itself in the shortlist, else its cluster's logit at shortlist - 1 + i.
        # A cluster-i token's id is >= cutoff_i >= shortlist + i - 1 (the cutoffs increase), so the column is the
        # smaller of the two: one kernel, where a where on cluster == 0 took three. An ignored target stays -100.
        head_col = torch.minimum(target, cluster + (self.shortlist - 1))  # (N,)
        nll = F.nll_loss(head, head_col, reduction="none", ignore_index=IGNORE_INDEX)  # (N,)
        if rows_mode(self.rows) == "all":
            tails = [self._log_softmax(hidden, clusters[i]) for i in range(1, self.n_clusters + 1)]
            return nll - self._tails_static(tails, target, cluster)
        for i in range(1, self.n_clusters + 1):
            idx = (cluster == i).nonzero().squeeze(1)  # (N_i,)
            if idx.numel() or self.every_cluster:
                tail = self._log_softmax(hidden[idx], clusters[i])  # (N_i, W_i)
                tail_logp = tail.gather(1, (target[idx] - self.bounds[i])[:, None]).squeeze(1)
                nll = nll.index_add(0, idx, tail_logp, alpha=-1)
        return nll

    def _tails_static(self, tails: list[torch.Tensor], target: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        """(N,) each token's log-probability within its tail cluster (0 for the head's tokens), read from ``tails``,
        every tail cluster's (N, W_i) log-probabilities of every token ('all' rows: shapes that do not depend on
        the targets).

        ``nonzero()`` has a data-dependent output shape: a host sync eagerly on a GPU, a graph break (or an
        unbacked size) for the compiler. Here every token is scored by every tail cluster (its target clamped
        into the cluster's range) and keeps only its own cluster's log-probability: one graph, no sync, the
        same values, and more work, which the narrow tails of div_val > 1 keep small (benchmarks/README.md).
        """
        logp = None
        for i, tail in enumerate(tails, start=1):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            tail_logp = tail.gather(1, (target - lo).clamp(0, hi - lo - 1)[:, None]).squeeze(1)  # (N,)
            # Other clusters' tokens add 0: masked_fill, one kernel forward and backward (where's zeros two).
            tail_logp = tail_logp.masked_fill(cluster != i, 0.0)  # (N,)
            logp = tail_logp if logp is None else logp + tail_logp
        return logp
