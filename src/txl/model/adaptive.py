"""Adaptive input embeddings (Baevski & Auli 2019) and the projected adaptive log-softmax (Grave et al. 2017).

Shape legend: N tokens (B*T), V vocabulary, d d_model, e_i cluster i's width (d_embed // div_val**i), C tail clusters,
W_i cluster i's matmul width (padded), cap the rows a tail scores ('capacity').

The vocabulary, most frequent first, is split at ``cutoffs`` into a head (shortlist) and C tail clusters. The head
scores the shortlist and one logit per tail cluster, cluster i (1-based) in column shortlist + i - 1 (Hugging Face's
and the TensorFlow original's order; the converter reorders the PyTorch original's); a tail token's log-probability
is log p(cluster) + log p(token | cluster).

Which rows a tail cluster scores is ``ComputeConfig.cluster_rows`` (the model's plan): its own tokens ('selected',
found with ``nonzero``: the least work, a host sync per cluster); a fixed number of rows its tokens fill in order
('capacity': static shapes for torch.compile and CUDA graphs); or every token ('all'). 'capacity''s rows are the worst
batch's counts where the batches are known ahead (``fit_capacity``), else a Zipf bound (``capacities``); a label
beyond them raises in the input check (``check_rows``), NaN on a GPU. Each tail's rows are scored in 4 blocks, so
the peak memory stays under 'selected''s (benchmarks/README.md, "The adaptive softmax's rows at NVIDIA's shape").

A 'selected' tail no token falls in is skipped (no gradient); ``every_cluster = True`` (``txl.parallel.shard``) runs
it on no rows (zero gradients), so that FSDP processes reduce-scatter the same gradients.
"""

from __future__ import annotations

import math

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
    """Embedding width of each cluster: d_embed // div_val**i (d_embed for all when div_val = 1)."""
    return [config.d_embed // config.div_val ** i for i in range(config.n_clusters + 1)]


def rows_mode(rows: str) -> str:
    """The planned ``cluster_rows``; under torch.compile 'capacity' for 'selected' (``nonzero`` breaks a graph)."""
    return "capacity" if rows == "selected" and torch.compiler.is_compiling() else rows


def zipf_shares(config: ModelConfig) -> list[float]:
    """Each cluster's share (head first) of Zipf-distributed ids, p(id) ~ 1 / (id + 1): H(hi) - H(lo) over H(V),
    with the harmonic number H(n) ~ ln n + 0.5772 + 1 / 2n."""
    H = [math.log(n) + 0.5772 + 1 / (2 * n) if n else 0.0 for n in cluster_bounds(config)]  # H(bounds[i])
    return [(hi - lo) / H[-1] for lo, hi in zip(H, H[1:])]


def cluster_of(target: torch.Tensor, cutoffs: list[int]) -> torch.Tensor:
    """(N,) ids -> (N,) int64 cluster index (0 = head): how many cutoffs each id reaches (elementwise comparisons:
    the compiler's ``bucketize`` failed in Triton on a GPU)."""
    cluster = (target >= cutoffs[0]).long()  # (N,)
    for c in cutoffs[1:]:
        cluster += target >= c
    return cluster


class AdaptiveEmbedding(nn.Module):
    """Token ids (B, T) -> (B, T, d) embeddings, scaled by sqrt(d) as the original."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bounds, self.every_cluster = cluster_bounds(config), False  # every_cluster: the module docstring
        self.rows = "selected"  # the model's plan sets it
        self.d_proj, self.scale = config.d_model, config.d_model ** 0.5
        self.layers, self.projs = nn.ModuleList(), nn.ParameterList()
        if config.div_val == 1:  # one table for the whole vocabulary, projected only if needed
            self.layers.append(nn.Embedding(config.vocab_size, config.d_embed))
            if config.d_embed != config.d_model:
                self.projs.append(nn.Parameter(torch.zeros(config.d_model, config.d_embed)))
        else:
            for i, width in enumerate(cluster_widths(config)):
                self.layers.append(nn.Embedding(self.bounds[i + 1] - self.bounds[i], width))
                self.projs.append(nn.Parameter(torch.zeros(config.d_model, width)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.layers) == 1:
            emb = self.layers[0](ids)  # (B, T, e)
            return (F.linear(emb, self.projs[0]) if len(self.projs) else emb) * self.scale  # (B, T, d)
        flat, out, static = ids.reshape(-1), 0.0, rows_mode(self.rows) != "selected"  # flat: (N,)
        for i, layer in enumerate(self.layers):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            mine = (flat >= lo) & (flat < hi)  # (N,)
            if static:  # every cluster embeds every token (id clamped into range), keeps its own rows: e_i x d a token
                emb = F.linear(layer((flat - lo).clamp(0, hi - lo - 1)), self.projs[i])  # (N, d)
                emb = torch.where(mine[:, None], emb, torch.zeros_like(emb))  # (N, d)
                out = emb if i == 0 else out + emb
                continue
            idx = mine.nonzero().squeeze(1)  # (N_i,)
            if idx.numel() or self.every_cluster:
                emb = F.linear(layer(flat[idx] - lo), self.projs[i])  # (N_i, d)
                if not isinstance(out, torch.Tensor):
                    out = emb.new_zeros(flat.size(0), self.d_proj)  # (N, d)
                out = out.index_copy(0, idx, emb.to(out.dtype))
        return out.view(*ids.shape, self.d_proj) * self.scale  # (B, T, d)


Cluster = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""One output matmul: weight (W_i, e_i), bias (W_i,), projection (d, e_i) or None; W_i padded (zero rows, bias -inf)."""


class AdaptiveLogSoftmax(nn.Module):
    """Projected adaptive log-softmax; a plain (optionally projected) softmax when there are no cutoffs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bounds, self.every_cluster = cluster_bounds(config), False  # every_cluster: the module docstring
        self.rows, self.pad = "selected", 1  # the model's plan sets them
        self.shortlist, self.n_clusters, self.div_val = self.bounds[1], config.n_clusters, config.div_val
        self.cast_weights, self.shares, self.caps = "auto", zipf_shares(config)[1:], None  # the plan; fit_capacity
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, config.d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.layers, self.projs = nn.ModuleList(), nn.ParameterList()
        if config.div_val == 1:
            self.layers.append(nn.Linear(config.d_embed, config.vocab_size))
            if config.d_embed != config.d_model:  # one projection per cluster, as the original
                for _ in range(self.n_clusters + 1):
                    self.projs.append(nn.Parameter(torch.zeros(config.d_model, config.d_embed)))
        else:
            for i, width in enumerate(cluster_widths(config)):
                self.layers.append(nn.Linear(width, self.bounds[i + 1] - self.bounds[i]))
                self.projs.append(nn.Parameter(torch.zeros(config.d_model, width)))

    def _clusters(self, dtype: torch.dtype) -> list[Cluster]:
        """Every cluster's weight, bias and projection (0 = head), in ``dtype``, padded (``softmax_pad``): each
        parameter cast once and sliced after (slices miss autocast's cache of cast weights)."""
        params = [p for layer in self.layers for p in (layer.weight, layer.bias)]  # _cast_clusters's order
        params += ([self.cluster_weight, self.cluster_bias] if self.n_clusters else []) + list(self.projs)
        if self.cast_weights != "per_use" and not torch.compiler.is_compiling() and casting.groupable(params, dtype):
            return self._cast_clusters(params, dtype)
        weights = [layer.weight.to(dtype) for layer in self.layers]  # (V_i, e_i) each, or one (V, e)
        biases = [layer.bias.to(dtype) for layer in self.layers]
        if self.div_val == 1 and self.n_clusters:  # views of one cast (split's backward is one cat)
            sizes = [hi - lo for lo, hi in zip(self.bounds, self.bounds[1:])]
            weights, biases = list(weights[0].split(sizes)), list(biases[0].split(sizes))
        out = []
        for i, (weight, bias) in enumerate(zip(weights, biases)):
            w_parts, b_parts = [weight], [bias]
            if i == 0 and self.n_clusters:  # the head also scores one logit per tail cluster
                w_parts, b_parts = [weight, self.cluster_weight.to(dtype)], [bias, self.cluster_bias.to(dtype)]
            extra = -sum(p.size(0) for p in w_parts) % self.pad
            if extra:  # zero rows scored -inf: exp(-inf) = 0 adds nothing to the softmax
                w_parts.append(weight.new_zeros(extra, weight.size(1)))
                b_parts.append(bias.new_full((extra,), float("-inf")))
            weight, bias = (torch.cat(w_parts), torch.cat(b_parts)) if len(w_parts) > 1 else (weight, bias)  # (W_i, .)
            out.append((weight, bias, self.projs[i].to(dtype) if len(self.projs) else None))
        return out

    def _cast_clusters(self, params: list[torch.Tensor], dtype: torch.dtype) -> list[Cluster]:
        """``_clusters`` by one op (``casting.cast_rows``; ``cast_weights`` groups): every weight, bias and projection
        cast and laid out (cluster rows after the shortlist, padding after each), gradients cast back by one."""
        n_layers, C, layouts = len(self.layers), self.n_clusters, []
        for i, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:])):
            w = 0 if self.div_val == 1 else 2 * i  # the layer holding cluster i's rows
            first, last = (lo, hi) if self.div_val == 1 else (0, hi - lo)
            rows_w, rows_b = [(w, first, last)], [(w + 1, first, last)]
            if i == 0 and C:  # the head also scores one logit per tail cluster
                rows_w, rows_b = [*rows_w, (2 * n_layers, 0, C)], [*rows_b, (2 * n_layers + 1, 0, C)]
            extra = -(last - first + (C if i == 0 else 0)) % self.pad  # zero rows scored -inf
            layouts += [rows_w + [extra] * bool(extra), rows_b + [extra] * bool(extra)]
        layouts += [[(2 * n_layers + (2 if C else 0) + j, 0, p.size(0))] for j, p in enumerate(self.projs)]
        n = len(self.bounds) - 1
        cast = casting.cast_rows(params, layouts, [0.0, float("-inf")] * n + [0.0] * len(self.projs), dtype)
        projs = cast[2 * n:]
        return [(cast[2 * i], cast[2 * i + 1], projs[i] if projs else None) for i in range(n)]

    @staticmethod
    def _log_softmax(hidden: torch.Tensor, cluster: Cluster) -> torch.Tensor:
        """(N, d) hidden in the clusters' dtype -> (N, W_i) float32 log-probabilities (-inf in padded columns)."""
        weight, bias, proj = cluster
        hidden = hidden if proj is None else torch.matmul(hidden, proj)  # (N, e_i)
        return torch.log_softmax(F.linear(hidden, weight, bias), dim=-1, dtype=torch.float32)  # (N, W_i)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N, V) log-probabilities over the whole vocabulary (float32)."""
        hidden, clusters = hidden.to(dtype := compute_dtype(hidden)), self._clusters(dtype)  # autocast's
        head, *tails = [self._log_softmax(hidden, cluster) for cluster in clusters]  # (N, W_i) each
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            col, width = self.shortlist + i - 1, self.bounds[i + 1] - self.bounds[i]
            parts.append(head[:, col : col + 1] + tails[i - 1][:, :width])  # (N, V_i)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def nll(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(N, d), (N,) -> (N,) negative log-likelihood in token order; 0 where target is IGNORE_INDEX (in no tail).
        The head's term is ``F.nll_loss``, a tail's log-probability subtracted: -h - t is -(h + t) exactly."""
        hidden, clusters = hidden.to(dtype := compute_dtype(hidden)), self._clusters(dtype)  # cast once
        head = self._log_softmax(hidden, clusters[0])  # (N, W_0)
        if not self.n_clusters:  # a plain softmax: the head alone
            return F.nll_loss(head, target, reduction="none", ignore_index=IGNORE_INDEX)  # (N,)
        cluster = cluster_of(target, self.bounds[1:-1])  # (N,): 0 for the head and for an ignored target
        # The head column of each token: itself in the shortlist, else its cluster's logit at shortlist - 1 + i. A
        # cluster-i id is >= cutoff_i >= shortlist + i - 1 (the cutoffs increase): the smaller of the two.
        head_col = torch.minimum(target, cluster + (self.shortlist - 1))  # (N,)
        nll = F.nll_loss(head, head_col, reduction="none", ignore_index=IGNORE_INDEX)  # (N,)
        static = rows_mode(self.rows) != "selected"
        lost = torch.zeros_like(cluster, dtype=torch.bool) if static else None  # tokens beyond their tail's rows
        for i, cap in enumerate(self.capacities(target.size(0)), start=1):
            mine = cluster == i  # (N,)
            if not static:
                idx = mine.nonzero().squeeze(1)  # (N_i,)
                if idx.numel() or self.every_cluster:
                    nll = nll.index_add(0, idx, self._tail_logp(hidden, clusters[i], target, i, idx), alpha=-1)
                continue
            # Static shapes (no nonzero, no host sync): cap rows, filled by the tail's tokens in order; token 0 fills an
            # empty one (scored, never read), a token beyond them goes to row cap, cut off.
            slot = mine.cumsum(0) - 1  # (N,): a cluster-i token's place among them
            kept = mine & (slot < cap)  # (N,)
            rows = torch.zeros(cap + 1, dtype=torch.long, device=target.device).scatter(
                0, torch.where(kept, slot, cap), torch.arange(target.size(0), device=target.device))[:cap]
            tail_logp = self._tail_logp(hidden, clusters[i], target, i, rows, pieces=4)  # (cap,)
            nll = nll - tail_logp.gather(0, slot.clamp(0, cap - 1)).masked_fill(~kept, 0.0)  # (N,) read back
            lost |= mine & ~kept
        return nll.masked_fill(lost, float("nan")) if static else nll

    def _tail_logp(self, hidden: torch.Tensor, cluster: Cluster, target: torch.Tensor, i: int, rows: torch.Tensor,
                   pieces: int = 1) -> torch.Tensor:
        """(R,) log p(target | tail cluster i) of the tokens at ``rows`` (R,), scored in ``pieces`` row blocks."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        out = [self._log_softmax(hidden[part], cluster).gather(1, (target[part] - lo).clamp(0, hi - lo - 1)[:, None])
               for part in rows.split(max(1, -(-rows.numel() // pieces)))]  # (R / pieces, 1) each
        return torch.cat(out).squeeze(1) if len(out) > 1 else out[0].squeeze(1)

    def capacities(self, n: int) -> list[int]:
        """Rows each tail scores out of n, at most n: n ('all'); for 'capacity' ``caps`` (fitted to the data), else
        its Zipf share p's expected count, 6 standard deviations (a Poisson count's) and 8, rounded up to 8s."""
        zipf = [-(-math.ceil(n * p + 6 * math.sqrt(n * p) + 8) // 8) * 8 for p in self.shares]
        return [n if self.rows == "all" else min(n, cap) for cap in self.caps or zipf]

    def fit_capacity(self, counts: list[int]) -> None:
        """``caps`` from the data: counts[i] the most labels one call puts in tail i + 1 over every batch of a run,
        counted ahead (``OrderedIterator.tail_counts``), rounded up to 8, never shrunk: no batch counted overflows."""
        self.caps = [max(c, 8 * -(-k // 8), 8) for c, k in zip(self.caps or [0] * self.n_clusters, counts, strict=True)]

    def check_rows(self, target: torch.Tensor) -> None:
        """Raise a ValueError naming the fix if a tail holds more of ``target``'s labels than its 'capacity' rows: where
        labels are on the host (``TransformerXL.check_inputs``); on a device their NLL is NaN."""
        n, target, capacity = target.numel(), target.reshape(-1), self.rows == "capacity" and self.n_clusters
        cluster = cluster_of(target[target != IGNORE_INDEX], self.bounds[1:-1]) if capacity else None
        for i, cap in enumerate(self.capacities(n) if capacity else [], start=1):
            if (count := int((cluster == i).sum())) > cap:
                raise ValueError(f"{count} of {n} labels fall in tail cluster {i} (ids {self.bounds[i]} to "
                                 f"{self.bounds[i + 1] - 1}), more than its {cap} cluster_rows='capacity' rows (sized "
                                 "for other batches or Zipf's law): use --compute.cluster_rows all (eagerly: selected)")
