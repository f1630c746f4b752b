"""Adaptive input embeddings (Baevski & Auli 2019) and the projected adaptive log-softmax (Grave et al. 2017).

Shape legend: N tokens (flattened B*T), V vocabulary, d d_model (= d_proj), e_i the embedding width of
cluster i (d_embed // div_val**i), C number of tail clusters.

The vocabulary, most frequent first, is split at ``cutoffs`` into a head (shortlist) and C tail
clusters. The head softmax scores the shortlist plus one logit per tail cluster; a tail token's
log-probability is log p(cluster) + log p(token | cluster). Tail cluster i (1-based) is scored by head
column shortlist + i - 1, the order of Hugging Face and the TensorFlow original (the original PyTorch
code reads column -i, i.e. the cluster rows reversed; the converter reorders such checkpoints).

Which rows a tail cluster computes is ``ModelConfig.cluster_rows``: only its own tokens ('selected', found with
``nonzero``: the least work, a host sync per cluster), or every token with the others masked out ('all':
static shapes and no sync, for torch.compile and CUDA graphs); 'auto' picks 'selected' eagerly on the CPU and
'all' elsewhere. A token's cluster is a sum of comparisons with the cutoffs (Python ints), so no tensor of
the cutoffs is made per call and the compiler sees plain elementwise ops.

Under autocast the output weights are cast once per call and sliced after (tied to the input embedding,
they are one (V, e) table: per-slice casts would copy it piece by piece, and the head's cat again); with
``ModelConfig.softmax_pad`` each matmul's width is padded with zero rows scored -inf.

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


def rows_mode(setting: str, device: torch.device) -> str:
    """``ModelConfig.cluster_rows`` resolved on ``device``: 'selected' or 'all'.

    Under torch.compile always 'all': ``nonzero``'s data-dependent shape would break the graph.
    """
    if torch.compiler.is_compiling():
        return "all"
    if setting == "auto":
        return "selected" if device.type == "cpu" else "all"
    return setting


def pad_multiple(setting: int, device: torch.device) -> int:
    """``ModelConfig.softmax_pad`` resolved on ``device``: the multiple each softmax width is padded to."""
    if setting:
        return setting
    return 64 if device.type == "cuda" else 1


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
        self.rows = config.cluster_rows
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
        if rows_mode(self.rows, flat.device) == "all":
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
        self.rows = config.cluster_rows
        self.pad = config.softmax_pad
        self.vocab_size = config.vocab_size
        self.shortlist = self.bounds[1]
        self.n_clusters = config.n_clusters
        self.div_val = config.div_val
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
        pad = pad_multiple(self.pad, device)
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
        head = self._log_softmax(hidden, clusters[0])  # (N, W_0)
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            col, width = self.shortlist + i - 1, self.bounds[i + 1] - self.bounds[i]
            parts.append(head[:, col : col + 1] + self._log_softmax(hidden, clusters[i])[:, :width])  # (N, V_i)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def nll(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(N, d), (N,) -> (N,) negative log-likelihood in token order; 0 where target is IGNORE_INDEX.

        Each tail cluster scores the tokens whose target falls in it (``cluster_rows``).
        """
        ignored = target == IGNORE_INDEX  # (N,): one kernel, read twice
        target = target.masked_fill(ignored, 0)
        hidden, clusters = self._prepare(hidden)
        head = self._log_softmax(hidden, clusters[0])  # (N, W_0)
        if not self.n_clusters:  # a plain softmax: one gather
            return -head.gather(1, target[:, None]).squeeze(1).masked_fill(ignored, 0.0)
        # Which head column scores each token: itself in the shortlist, else its cluster's logit.
        cluster = cluster_of(target, self.bounds[1:-1])  # (N,)
        head_col = torch.where(cluster == 0, target, cluster + (self.shortlist - 1))  # (N,)
        logp = head.gather(1, head_col[:, None]).squeeze(1)  # (N,)
        if rows_mode(self.rows, hidden.device) == "all":
            return -self._tails_static(hidden, clusters, target, cluster, logp).masked_fill(ignored, 0.0)
        for i in range(1, self.n_clusters + 1):
            idx = (cluster == i).nonzero().squeeze(1)  # (N_i,)
            if idx.numel() or self.every_cluster:
                tail = self._log_softmax(hidden[idx], clusters[i])  # (N_i, W_i)
                tail_logp = tail.gather(1, (target[idx] - self.bounds[i])[:, None]).squeeze(1)
                logp = logp.index_add(0, idx, tail_logp)
        return -logp.masked_fill(ignored, 0.0)

    def _tails_static(self, hidden: torch.Tensor, clusters: list[Cluster], target: torch.Tensor,
                      cluster: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """``nll``'s tail clusters with shapes that do not depend on the targets ('all' rows).

        ``nonzero()`` has a data-dependent output shape: a host sync eagerly on a GPU, a graph break (or an
        unbacked size) for the compiler. Here every token is scored by every tail cluster (its target clamped
        into the cluster's range) and keeps only its own cluster's log-probability: one graph, no sync, the
        same values, and more work, which the narrow tails of div_val > 1 keep small (benchmarks/README.md).
        """
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            tail = self._log_softmax(hidden, clusters[i])  # (N, W_i): every token
            tail_logp = tail.gather(1, (target - lo).clamp(0, hi - lo - 1)[:, None]).squeeze(1)  # (N,)
            # Other clusters' tokens add 0: masked_fill, one kernel forward and backward (where's zeros took two).
            logp = logp + tail_logp.masked_fill(cluster != i, 0.0)  # (N,)
        return logp
