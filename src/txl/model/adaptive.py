"""Adaptive input embeddings (Baevski & Auli 2019) and the projected adaptive log-softmax (Grave et al. 2017).

Shape legend: N tokens (flattened B*T), V vocabulary, d d_model (= d_proj), e_i the embedding width of
cluster i (d_embed // div_val**i), C number of tail clusters.

The vocabulary, most frequent first, is split at ``cutoffs`` into a head (shortlist) and C tail
clusters. The head softmax scores the shortlist plus one logit per tail cluster; a tail token's
log-probability is log p(cluster) + log p(token | cluster). Tail cluster i (1-based) is scored by head
column shortlist + i - 1, the order of Hugging Face and the TensorFlow original (the original PyTorch
code reads column -i, i.e. the cluster rows reversed; the converter reorders such checkpoints).

Which rows a tail cluster scores is ``ModelConfig.cluster_rows``: only its own tokens ('selected', found with
``nonzero``: the least work, a data-dependent shape and a host sync per cluster); a fixed number of rows that its
tokens fill in order ('capacity': static shapes for torch.compile and CUDA graphs, about the work of 'selected'); or
every token ('all': exact for any batch, 2.4x the training step's FLOPs at NVIDIA's WikiText-103 shape). 'auto'
picks 'selected' eagerly on the CPU and 'capacity' elsewhere and under torch.compile (``txl.model.plan``).

'capacity' rows. Static shapes cost what the worst batch costs: a path exact for every batch scores every token
against the widest tail, whatever the batch holds. So a tail's capacity is sized for a batch of Zipf-distributed
labels (p(id) ~ 1 / (id + 1), ids most frequent first; a word-level corpus puts fewer in the tails than that):
their expected count plus 6 standard deviations (``tail_rows``). A label beyond it is loud: the model's input
check raises where labels are read on the host (``check_rows``), and on a device its NLL is NaN, read back with the
loss. A tail is scored in 4 pieces, so at most a quarter of its logits and their gradients exist at a time beside
those kept for backward: the peak memory stays under 'selected''s (benchmarks/adaptive_softmax.py).

Under autocast the output weights are cast once per call and sliced after (tied to the input embedding,
they are one (V, e) table: per-slice casts would copy it piece by piece, and the head's cat again); with
``ModelConfig.softmax_pad`` each matmul's width is padded with zero rows scored -inf. Where
``ModelConfig.cast_weights`` groups, one copy kernel casts and lays out all of them, the head's cluster rows and
the padding included (``txl.model.casting.cast_rows``), and one casts their gradients back.

Selected rows: a tail cluster that no token of the batch falls in is skipped, so its parameters get no gradient.
``every_cluster = True`` (set by ``txl.parallel.shard``) runs it anyway on no rows: its gradient is then zeros.
FSDP needs that: every process must reduce-scatter the same gradients, whichever clusters its shard of the
batch used (torch 2.13's ``set_reduce_scatter_unused_params`` does the same inside FSDP; this works with every
FSDP2 release).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from txl.config import ModelConfig
from txl.labels import IGNORE_INDEX
from txl.model import casting, plan
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
    """The planned ``cluster_rows``, except under torch.compile: 'capacity' for 'selected' there (``nonzero``'s
    data-dependent shape would break the graph)."""
    return "capacity" if rows == "selected" and torch.compiler.is_compiling() else rows


def zipf_share(lo: int, hi: int, vocab_size: int) -> float:
    """The share of ids lo <= id < hi among Zipf-distributed ids, p(id) ~ 1 / (id + 1): H(hi) - H(lo) over H(V),
    with the harmonic number H(n) ~ ln n + 0.5772 + 1 / 2n (within 1 / 12n^2)."""
    def harmonic(n: int) -> float:
        return math.log(n) + 0.5772156649015329 + 0.5 / n if n else 0.0
    return (harmonic(hi) - harmonic(lo)) / harmonic(vocab_size)


def tail_rows(n: int, share: float) -> int:
    """'capacity' rows of a tail cluster with ``share`` of n labels: the expected count plus 6 standard deviations
    (a Poisson count's) and 8, a multiple of 8, at most n (a small batch keeps every row)."""
    expected = n * share
    return min(n, -(-math.ceil(expected + 6 * math.sqrt(expected) + 8) // 8) * 8)


def cluster_of(target: torch.Tensor, cutoffs: list[int]) -> torch.Tensor:
    """(N,) ids -> (N,) int64 cluster index (0 = head): how many cutoffs each id reaches. Comparisons with Python
    ints, not ``bucketize``: no tensor per call, plain elementwise ops for the compiler (its bucketize failed in
    Triton on a GPU)."""
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
        self.rows = plan.resolved("cluster_rows", config.cluster_rows, "cpu")  # the model's plan sets it
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
        if rows_mode(self.rows) != "selected":
            # Shapes that do not depend on the ids: every cluster embeds every token (ids clamped into its range)
            # and keeps its own rows. A lookup and a d x e_i projection a token: the output layer's work is the
            # tails' V_i x e_i, which 'capacity' keeps to the tails' tokens.
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
        self.rows = plan.resolved("cluster_rows", config.cluster_rows, "cpu")  # the model's plan sets it
        self.pad = plan.resolved("softmax_pad", config.softmax_pad, "cpu")  # the model's plan sets it
        self.vocab_size = config.vocab_size
        self.shortlist = self.bounds[1]
        self.n_clusters = config.n_clusters
        self.div_val = config.div_val
        self.cast_weights = config.cast_weights
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
        """``_clusters`` in one grouped op (``casting.cast_rows``), where ``ModelConfig.cast_weights`` groups: every
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

        Each tail cluster scores the rows ``cluster_rows`` says. The head's term is ``F.nll_loss`` (no reduction):
        -log p of the column, 0 for an ignored target (in no cluster: it scores no tail), in one kernel. A tail's
        log-probability is subtracted: -h - t is -(h + t) exactly (rounding is symmetric).
        """
        hidden, clusters = self._prepare(hidden)
        head = self._log_softmax(hidden, clusters[0])  # (N, W_0)
        if not self.n_clusters:  # a plain softmax: the head alone
            return F.nll_loss(head, target, reduction="none", ignore_index=IGNORE_INDEX)  # (N,)
        cluster = cluster_of(target, self.bounds[1:-1])  # (N,): 0 for the head and for an ignored target
        # The head column of each token: itself in the shortlist, else its cluster's logit at shortlist - 1 + i. A
        # cluster-i id is >= cutoff_i >= shortlist + i - 1 (the cutoffs increase): the smaller of the two.
        head_col = torch.minimum(target, cluster + (self.shortlist - 1))  # (N,)
        nll = F.nll_loss(head, head_col, reduction="none", ignore_index=IGNORE_INDEX)  # (N,)
        if rows_mode(self.rows) != "selected":
            return self._tails_static(nll, hidden, clusters, target, cluster)
        for i in range(1, self.n_clusters + 1):
            idx = (cluster == i).nonzero().squeeze(1)  # (N_i,)
            if idx.numel() or self.every_cluster:
                tail = self._log_softmax(hidden[idx], clusters[i])  # (N_i, W_i)
                tail_logp = tail.gather(1, (target[idx] - self.bounds[i])[:, None]).squeeze(1)
                nll = nll.index_add(0, idx, tail_logp, alpha=-1)
        return nll

    def capacities(self, n: int) -> list[int]:
        """Rows each tail cluster scores out of n: all n ('all'), or ``tail_rows`` of its Zipf share ('capacity')."""
        V = self.vocab_size
        return [n if self.rows == "all" else tail_rows(n, zipf_share(lo, hi, V))
                for lo, hi in zip(self.bounds[1:-1], self.bounds[2:])]

    def check_rows(self, target: torch.Tensor) -> None:
        """Raise a ValueError if a tail cluster holds more of ``target``'s labels than its 'capacity' rows: where the
        labels are read on the host (``TransformerXL.check_inputs``); on a device their NLL is NaN instead."""
        if self.rows != "capacity" or not self.n_clusters:
            return
        target = target.reshape(-1)
        counts = torch.bincount(cluster_of(target[target != IGNORE_INDEX], self.bounds[1:-1]), minlength=len(
            self.bounds) - 1).tolist()[1:]
        for i, (count, cap) in enumerate(zip(counts, self.capacities(target.numel())), start=1):
            if count > cap:
                raise ValueError(
                    f"{count} of {target.numel()} labels fall in tail cluster {i} (ids {self.bounds[i]} to "
                    f"{self.bounds[i + 1] - 1}), more than the {cap} rows cluster_rows='capacity' gives it (sized for "
                    "Zipf-distributed labels, ids most frequent first): set --model.cluster_rows all (every row, "
                    "exact for any batch), or 'selected' in eager mode")

    def _tails_static(self, nll: torch.Tensor, hidden: torch.Tensor, clusters: list[Cluster], target: torch.Tensor,
                      cluster: torch.Tensor) -> torch.Tensor:
        """``nll`` less each tail token's log-probability within its cluster, in shapes that do not depend on the
        targets (no ``nonzero``: no host sync, one graph): tail i scores a fixed number of rows (``capacities``),
        which its tokens fill in token order. A token beyond them gets NaN (see the module docstring)."""
        N, lost = target.size(0), torch.zeros_like(cluster, dtype=torch.bool)
        for i, cap in enumerate(self.capacities(N), start=1):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            mine = cluster == i  # (N,)
            slot = mine.cumsum(0) - 1  # (N,): a cluster-i token's place among them
            kept = mine & (slot < cap)  # (N,)
            # (cap,) the token in each place (token 0 where none is: scored, never read); a token not kept is
            # written to place cap, cut off.
            rows = torch.zeros(cap + 1, dtype=torch.long, device=target.device).scatter(
                0, torch.where(kept, slot, cap), torch.arange(N, device=target.device))[:cap]
            pieces = []
            for part in rows.split(-(-cap // 4)):  # a quarter of the logits at a time (the module docstring)
                tail = self._log_softmax(hidden[part], clusters[i])  # (cap / 4, W_i)
                pieces.append(tail.gather(1, (target[part] - lo).clamp(0, hi - lo - 1)[:, None]).squeeze(1))
            tail_logp = torch.cat(pieces).gather(0, slot.clamp(0, cap - 1))  # (N,) each token's place read back
            nll = nll - tail_logp.masked_fill(~kept, 0.0)  # other clusters' tokens subtract 0
            lost |= mine & ~kept
        return nll.masked_fill(lost, float("nan"))
