"""Adaptive input embeddings (Baevski & Auli 2019) and the projected adaptive log-softmax (Grave et al. 2017).

Shape legend: N tokens (flattened B*T), V vocabulary, d d_model (= d_proj), e_i the embedding width of
cluster i (d_embed // div_val**i), C number of tail clusters.

The vocabulary, most frequent first, is split at ``cutoffs`` into a head (shortlist) and C tail
clusters. The head softmax scores the shortlist plus one logit per tail cluster; a tail token's
log-probability is log p(cluster) + log p(token | cluster). Tail cluster i (1-based) is scored by head
column shortlist + i - 1, the order of Hugging Face and the TensorFlow original (the original PyTorch
code reads column -i, i.e. the cluster rows reversed; the converter reorders such checkpoints).

Eagerly, a tail cluster that no token of the batch falls in is skipped, so its parameters get no gradient.
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


def cluster_bounds(config: ModelConfig) -> list[int]:
    """[0, c_1, ..., c_C, V]: cluster i holds ids bounds[i] <= id < bounds[i + 1]."""
    return [0, *config.cutoffs, config.vocab_size]


def cluster_widths(config: ModelConfig) -> list[int]:
    """Embedding width of each cluster: d_embed for all when div_val = 1, else d_embed // div_val**i."""
    n = config.n_clusters + 1
    if config.div_val == 1:
        return [config.d_embed] * n
    return [config.d_embed // config.div_val ** i for i in range(n)]


class AdaptiveEmbedding(nn.Module):
    """Token ids (B, T) -> (B, T, d) embeddings, scaled by sqrt(d) as the original."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bounds = cluster_bounds(config)
        self.every_cluster = False  # see the module docstring
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
        if torch.compiler.is_compiling():
            # Tracing (torch.export) needs shapes that do not depend on the ids: every cluster embeds every
            # token (ids clamped into its range) and keeps the rows that are its own. Same values, more work.
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


class AdaptiveLogSoftmax(nn.Module):
    """Projected adaptive log-softmax; a plain (optionally projected) softmax when there are no cutoffs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bounds = cluster_bounds(config)
        self.every_cluster = False  # see the module docstring
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

    def _cluster(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Weight (V_i, e_i), bias (V_i,) and projection (d, e_i) or None of cluster i (0 = head)."""
        if self.div_val == 1:
            lo, hi = self.bounds[i], self.bounds[i + 1]
            weight, bias = self.layers[0].weight[lo:hi], self.layers[0].bias[lo:hi]
        else:
            weight, bias = self.layers[i].weight, self.layers[i].bias
        if i == 0 and self.n_clusters:  # the head also scores one logit per tail cluster
            weight = torch.cat([weight, self.cluster_weight])
            bias = torch.cat([bias, self.cluster_bias])
        proj = self.projs[i] if len(self.projs) else None
        return weight, bias, proj

    def _log_softmax(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        weight, bias, proj = self._cluster(i)
        if proj is not None:
            hidden = torch.matmul(hidden, proj.to(hidden.dtype))  # (N, e_i)
        logits = F.linear(hidden, weight, bias)  # (N, V_i)
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N, V) log-probabilities over the whole vocabulary (float32)."""
        head = self._log_softmax(hidden, 0)  # (N, shortlist + C)
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            col = self.shortlist + i - 1
            parts.append(head[:, col : col + 1] + self._log_softmax(hidden, i))  # (N, V_i)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def nll(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(N, d), (N,) -> (N,) negative log-likelihood in token order; 0 where target is IGNORE_INDEX.

        Each tail cluster is scored only for the tokens whose target falls in it.
        """
        valid = target != IGNORE_INDEX
        target = target.masked_fill(~valid, 0)
        head = self._log_softmax(hidden, 0)  # (N, shortlist + C)
        # Which head column scores each token: itself in the shortlist, else its cluster's logit.
        cluster = torch.bucketize(target, target.new_tensor(self.bounds[1:-1]), right=True)  # (N,)
        head_col = torch.where(cluster == 0, target, self.shortlist + cluster - 1)
        logp = head.gather(1, head_col[:, None]).squeeze(1)  # (N,)
        if torch.compiler.is_compiling():
            return -self._tails_static(hidden, target, cluster, logp).masked_fill(~valid, 0.0)
        for i in range(1, self.n_clusters + 1):
            idx = (cluster == i).nonzero().squeeze(1)  # (N_i,)
            if idx.numel() or self.every_cluster:
                tail = self._log_softmax(hidden[idx], i)  # (N_i, V_i)
                tail_logp = tail.gather(1, (target[idx] - self.bounds[i])[:, None]).squeeze(1)
                logp = logp.index_add(0, idx, tail_logp)
        return -logp.masked_fill(~valid, 0.0)

    def _tails_static(self, hidden: torch.Tensor, target: torch.Tensor, cluster: torch.Tensor,
                      logp: torch.Tensor) -> torch.Tensor:
        """``nll``'s tail clusters with shapes that do not depend on the targets, for torch.compile.

        ``nonzero()`` has a data-dependent output shape, a graph break (or an unbacked size) for the compiler.
        Here every token is scored by every tail cluster (its target clamped into the cluster's range) and
        keeps only its own cluster's log-probability: one graph, the same values, and more work, which the
        narrow tails of div_val > 1 keep small (benchmarks/README.md, compiled against eager).
        """
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            tail = self._log_softmax(hidden, i)  # (N, V_i): every token
            tail_logp = tail.gather(1, (target - lo).clamp(0, hi - lo - 1)[:, None]).squeeze(1)  # (N,)
            logp = logp + torch.where(cluster == i, tail_logp, torch.zeros_like(tail_logp))  # (N,)
        return logp
