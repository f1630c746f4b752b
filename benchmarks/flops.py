"""The FLOP model of the benchmark: its shapes and the FLOPs a token costs in each phase (no profiler).

With N the non-embedding matmul parameters (per layer q/k/v, output, and the two feed-forward matrices), S
the output layer's matmul parameters a token meets (the softmax; with an adaptive softmax the head for every
token and each tail cluster for the share of tokens that fall in it), L layers, H*D attention width and
K = M + T keys per query,

    train = 6 (N + S) + 3 * 6 L (H D) K     eval = 2 (N + S) + 6 L (H D) K

(benchmarks/run.py's docstring says what is and is not counted).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    d_inner: int
    tgt_len: int
    mem_len: int
    batch: int
    vocab_size: int = 204  # byte-level: 256 bytes less the unused, as enwik8's 204 symbols
    dropout: float = 0.1
    cutoffs: tuple[int, ...] = ()
    """Adaptive softmax cluster boundaries (empty: one full softmax)."""
    div_val: int = 1
    zipf: bool = False
    """Draw the tokens Zipf-distributed (p(rank r) ~ 1/r, as words in running text) instead of uniformly, so
    an adaptive softmax sees the share of head and tail tokens a word-level corpus gives it."""
    eval_tgt_len: int | None = None
    """Evaluation segment length (None: tgt_len)."""
    eval_mem_len: int | None = None
    """Evaluation memory length (None: mem_len)."""
    eval_batch: int | None = None
    """Evaluation batch (None: batch)."""
    model: tuple[tuple[str, object], ...] = ()
    """ModelConfig and ComputeConfig fields set with ``--model.FIELD`` / ``--compute.FIELD VALUE`` (e.g. dropout,
    attn_impl), for every phase."""

    def for_phase(self, phase: str) -> Shape:
        """The shape a phase runs: evaluation may read shorter segments against a longer memory."""
        if phase.startswith("train"):
            return self
        return dataclasses.replace(self, tgt_len=self.eval_tgt_len or self.tgt_len,
                                   mem_len=self.eval_mem_len or self.mem_len, batch=self.eval_batch or self.batch)

    def resized(self, *, batch: int | None = None, tgt_len: int | None = None, mem_len: int | None = None) -> Shape:
        """The shape with batch, segment or memory length overridden for training and evaluation alike
        (a reduced smoke run of a shape too large for the machine)."""
        changes: dict[str, int] = {}
        if batch:
            changes.update(batch=batch, eval_batch=batch)
        if tgt_len:
            changes.update(tgt_len=tgt_len, eval_tgt_len=tgt_len)
        if mem_len:
            changes.update(mem_len=mem_len, eval_mem_len=mem_len)
        return dataclasses.replace(self, **changes)

    def with_model(self, fields: dict[str, object]) -> Shape:
        """The shape with ModelConfig or ComputeConfig fields overridden (``--model.FIELD``, ``--compute.FIELD``)."""
        return dataclasses.replace(self, model=tuple(sorted({**dict(self.model), **fields}.items())))


SHAPES = {
    "tiny": Shape(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, tgt_len=16, mem_len=16, batch=2),
    "small": Shape(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=128, mem_len=128, batch=8),
    "base": Shape(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, tgt_len=256, mem_len=256, batch=4),
    # A word-level model a CPU can train: an adaptive softmax with two tail clusters (div_val 4), Zipf tokens.
    "word": Shape(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=64, mem_len=64, batch=8,
                  vocab_size=32000, cutoffs=(2000, 10000), div_val=4, zipf=True),
    # base at a size a GPU is busy with (16,384 tokens a step; base's 1,024 leave an H100 waiting on the host).
    "base-gpu": Shape(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, tgt_len=512, mem_len=512,
                      batch=32),
    # NVIDIA DeepLearningExamples, Transformer-XL PyTorch, WikiText-103 base (wt103_base.yaml), per GPU.
    "nvidia": Shape(n_layer=16, d_model=512, n_head=8, d_head=64, d_inner=2048, tgt_len=192, mem_len=192, batch=32,
                    vocab_size=267735, cutoffs=(20000, 40000, 200000), div_val=1, zipf=True,
                    eval_tgt_len=64, eval_mem_len=640, eval_batch=32),
}
# NVIDIA's published figures for that shape, one A100 80GB, AMP (DeepLearningExamples Transformer-XL README).
NVIDIA_A100 = {"train": 59961, "eval": 91654, "eval_torchscript": 107082}


def token_probs(shape: Shape) -> torch.Tensor:
    """(V,) float64 probabilities of the benchmark's tokens: uniform, or Zipf (1/rank) for word-level shapes."""
    if not shape.zipf:
        return torch.full((shape.vocab_size,), 1.0 / shape.vocab_size, dtype=torch.float64)
    p = 1.0 / torch.arange(1, shape.vocab_size + 1, dtype=torch.float64)
    return p / p.sum()


def matmul_params(shape: Shape) -> int:
    """N: non-embedding matmul parameters (q/k/v, output projection, feed-forward) of all layers."""
    hd = shape.n_head * shape.d_head
    return shape.n_layer * (3 * shape.d_model * hd + hd * shape.d_model + 2 * shape.d_model * shape.d_inner)


def softmax_params(shape: Shape) -> float:
    """S: output-layer matmul parameters per token, in expectation over the benchmark's tokens.

    Every token meets the head (the shortlist plus one logit per tail cluster); tail cluster i (its
    projection d -> d_embed / div_val^i, if any, and its words) only the tokens whose label falls in it.
    """
    bounds = [0, *shape.cutoffs, shape.vocab_size]
    probs = token_probs(shape)
    total = 0.0
    for i in range(len(bounds) - 1):
        width = shape.d_model // shape.div_val ** i
        rows = bounds[i + 1] - bounds[i] + (len(shape.cutoffs) if i == 0 else 0)
        params = rows * width + (shape.d_model * width if width != shape.d_model else 0)
        share = 1.0 if i == 0 else float(probs[bounds[i]:bounds[i + 1]].sum())
        total += share * params
    return total


def attention_flops(shape: Shape, klen: int, positional: bool = True) -> int:
    """Forward FLOPs per query of the K-long products: score, positional score (if any), values."""
    products = 3 if positional else 2
    return products * 2 * shape.n_layer * shape.n_head * shape.d_head * klen


def flops_per_token(shape: Shape, phase: str) -> float:
    shape = shape.for_phase(phase)
    klen = shape.mem_len + shape.tgt_len
    n, attn = matmul_params(shape) + softmax_params(shape), attention_flops(shape, klen)
    return 6 * n + 3 * attn if phase.startswith("train") else 2 * n + attn


def speedup_flop_ratio(shape: Shape, length: int, tgt_len: int | None = None) -> float:
    """Executed forward FLOPs per predicted token: a vanilla model slid over L-token windows against
    Transformer-XL reading T-token segments against M = L cached states (T = L unless ``tgt_len``), counting
    here W_kR R as well (the memory rows' keys and values come from the key/value cache of the previous
    segment, as in ``txl.evaluate``). The softmax is left out of both (the vanilla model scores one position
    per window, XL every position: a constant per predicted token)."""
    hd = shape.n_head * shape.d_head
    n = matmul_params(shape)
    vanilla = 2 * n * length + length * attention_flops(shape, length, positional=False)  # one window
    T = tgt_len or length
    klen = length + T
    xl = (2 * n + attention_flops(shape, klen)  # per segment token
          + shape.n_layer * 2 * shape.d_model * hd * klen / T)  # W_kR R, once per segment (batch 1)
    return vanilla / xl
