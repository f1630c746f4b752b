"""Typed, validated configuration of the Transformer-XL language model.

Configs are plain data (no callables) so they serialise to JSON and travel with every checkpoint.
Each option of the paper is a named field; combinations that cannot work are rejected in
``__post_init__`` with a message that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

AttnType = Literal["relative", "shaw", "absolute", "al_rfou", "rotary"]
SameLengthStyle = Literal["pytorch", "tensorflow"]
AttnImpl = Literal["fused", "reference"]
DropoutImpl = Literal["fast", "torch"]
CompressFn = Literal["mean", "max", "conv"]
ClusterRows = Literal["auto", "selected", "capacity", "all"]
CastWeights = Literal["auto", "per_use", "grouped"]


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean n_layer?)' for the choice closest to a misspelt ``name`` ('' when none is close)."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


SCORE_SEGMENT_LEN = 128
"""Tokens per forward pass of ``txl score`` and lm-eval's ``txl`` model when neither an option nor the run's [eval]
section gives one (here, below both: ``txl.lmeval`` reads it without the command line's modules)."""

MAX_MEMORY_ROWS = 1 << 20
"""The most rows a layer keeps (mem_len + cmem_len): 1,048,576, thousands of times the paper's longest memory
(3,800 rows, enwik8 evaluation) and far beyond what a training run fills."""

MOVED_FIELDS = ("attn_impl", "recompute_attention", "dropout_impl", "cluster_rows", "softmax_pad", "cast_weights")
"""How-fields a saved model section may hold: ModelConfig's until issue 45, ``ComputeConfig``'s since (they choose
how the model is computed, not what). A saved run's move to its compute section (``RunConfig.from_dict``); a model
read alone drops them (``ModelConfig.from_dict``): its weights load under any compute config."""
RETIRED_FIELDS = ("state_dtype", "residual_dtype")
"""How-fields a saved config may hold that are gone (issue 45: measured no win on the GPU): where autocast rounded
the memory, u, v and the residual stream. Read configs drop them: the model they describe is the same."""
RETIRED_VALUES = {("dropout_impl", "fast16"): "fast"}
"""Values of how-fields that are gone, and what a read config gets instead: 'fast16' (16-bit masks, p rounded to
2**-16) measured slower than 'fast' (nn.Dropout's distribution) on the CPU and is torch's kernel on a GPU."""


def retire(values: dict[str, Any]) -> dict[str, Any]:
    """A saved model or compute section with ``RETIRED_FIELDS`` dropped and ``RETIRED_VALUES`` replaced (checkpoints
    of before issue 45 load)."""
    out = {k: v for k, v in values.items() if k not in RETIRED_FIELDS}
    for (name, old), new in RETIRED_VALUES.items():
        if out.get(name) == old:
            out[name] = new
    return out


def split_compute(model: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A saved model section's what-fields and its how-fields (``MOVED_FIELDS``), both retired (``retire``)."""
    model = retire(model)
    return ({k: v for k, v in model.items() if k not in MOVED_FIELDS},
            {k: v for k, v in model.items() if k in MOVED_FIELDS})


@dataclass(kw_only=True)
class ModelConfig:
    """The architecture of a Transformer-XL language model (Dai et al., 2019)."""

    vocab_size: int
    """Number of tokens; ids run from 0 to vocab_size - 1, most frequent first when cutoffs are used."""
    n_layer: int = 4
    """Number of decoder layers."""
    d_model: int = 256
    """Width of the hidden states (and of the sinusoidal position encoding R)."""
    n_head: int = 4
    """Attention heads per layer."""
    d_head: int | None = None
    """Width of each head; None means d_model // n_head. n_head * d_head need not equal d_model."""
    d_inner: int = 1024
    """Hidden width of the position-wise feed-forward network."""
    d_embed: int | None = None
    """Width of the (first cluster of the) token embedding; None means d_model."""

    # Adaptive input and adaptive softmax (Baevski & Auli 2019; Grave et al. 2017).
    cutoffs: list[int] = field(default_factory=list)
    """Vocabulary cluster boundaries, strictly increasing and below vocab_size; [] is a plain softmax."""
    div_val: int = 1
    """Each further cluster's embedding width is divided by div_val (1: all clusters d_embed wide)."""
    tie_weight: bool = True
    """Share the output softmax weights with the input embedding of each cluster."""
    tie_projs: list[bool] | None = None
    """Per cluster, share the output projection with the input one. None: the original default,
    all but the head cluster (proj_share_all_but_first)."""

    # Regularisation.
    dropout: float = 0.1
    """Dropout on embeddings, positional encodings, attention output, feed-forward layers, final state."""
    dropatt: float = 0.0
    """Dropout on attention probabilities."""

    # Segment-level recurrence and the attention context.
    mem_len: int = 128
    """Hidden states kept per layer from earlier segments (0 turns recurrence off)."""
    ext_len: int = 0
    """Trailing tokens of each input segment that are re-fed as context of the next one and are
    therefore not written to memory (the original's extended context)."""
    clamp_len: int = -1
    """Relative distances beyond clamp_len share one encoding; <= 0 means no clamping."""
    same_length: bool = False
    """Every query attends to the same number of keys (used for evaluation in the paper)."""
    same_length_style: SameLengthStyle = "pytorch"
    """'pytorch': the original PyTorch and Hugging Face mask, each query sees mem_len keys.
    'tensorflow': the original TensorFlow and NVIDIA mask, each query sees mem_len + 1 keys."""

    # The Compressive Transformer's second memory (Rae et al. 2020; txl.model.compressive).
    cmem_len: int = 0
    """Compressed slots kept per layer: states leaving the memory are compressed cmem_rate to one instead of
    being dropped (0: none, today's Transformer-XL exactly)."""
    cmem_rate: int = 4
    """Compression rate c: c states leaving the memory make one compressed slot."""
    cmem_fn: CompressFn = "conv"
    """The compression function: 'conv' a 1-D convolution of kernel and stride c (the paper's best, trained by
    the attention-reconstruction loss), 'mean' or 'max' pooling over c states (no parameters)."""

    # Positional encoding: the paper's (relative) and its Table 6 ablations.
    attn_type: AttnType = "relative"
    """'relative': the paper's encoding, terms (a)+(b)+(c)+(d) with sinusoidal R and biases u, v.
    'shaw': Shaw et al. 2018, a learned embedding per relative distance.
    'absolute': Vaswani et al. 2017, sinusoid added to the input.
    'al_rfou': Al-Rfou et al. 2018, a learned absolute embedding added to every layer's input.
    'rotary': Su et al. 2021, queries and keys rotated by their index in [memory; segment] (relative)."""
    learned_positions: int = 512
    """Number of learned distances ('shaw') or positions ('al_rfou'); larger ones reuse the last."""
    untie_r: bool = False
    """One pair of global biases u, v per layer instead of one pair shared by all layers."""
    pre_ln: bool = False
    """Layer norm before each sub-layer (pre-LN) instead of after the residual (the paper's post-LN)."""
    layer_norm_eps: float = 1e-5
    # Initialisation, as the original: normal(0, init_std), projections normal(0, proj_init_std).
    init_std: float = 0.02
    proj_init_std: float = 0.01

    def __post_init__(self) -> None:
        if self.d_embed is None:
            self.d_embed = self.d_model
        if self.d_head is None:
            if not isinstance(self.n_head, int) or self.n_head < 1 or self.d_model % self.n_head:
                raise ValueError(
                    f"ModelConfig.n_head={self.n_head} does not divide d_model={self.d_model}: choose n_head "
                    "that divides d_model, or set d_head explicitly (n_head * d_head need not equal d_model)")
            self.d_head = self.d_model // self.n_head
        if not isinstance(self.cutoffs, (list, tuple)) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in self.cutoffs):
            raise ValueError(f"ModelConfig.cutoffs={self.cutoffs!r} must be a list of integers (token ids where "
                             "the adaptive softmax's clusters start, e.g. [20000, 40000])")
        self.cutoffs = list(self.cutoffs)
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "d_embed",
                     "div_val", "learned_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
        for name in ("mem_len", "ext_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be an integer >= 0")
        for name in ("dropout", "dropatt"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be in [0, 1)")
        if self.d_model % 2:
            raise ValueError(f"ModelConfig.d_model={self.d_model} must be even (sin and cos halves of R)")
        if self.cutoffs:
            if any(b <= a for a, b in zip(self.cutoffs, self.cutoffs[1:])) or self.cutoffs[0] <= 0:
                raise ValueError(
                    f"ModelConfig.cutoffs={self.cutoffs} must be strictly increasing positive integers, "
                    "e.g. [20000, 40000, 200000]")
            if self.cutoffs[-1] >= self.vocab_size:
                raise ValueError(
                    f"ModelConfig.cutoffs={self.cutoffs} must all be below vocab_size={self.vocab_size}; "
                    "drop the cutoffs at or beyond the vocabulary")
        if self.div_val > 1 and self.d_embed // self.div_val ** len(self.cutoffs) < 1:
            raise ValueError(
                f"ModelConfig.div_val={self.div_val} leaves the last cluster with no embedding width "
                f"(d_embed={self.d_embed}, {len(self.cutoffs)} cutoffs); lower div_val or raise d_embed")
        n_clusters = len(self.cutoffs) + 1
        if self.tie_projs is None:
            self.tie_projs = [False] + [True] * len(self.cutoffs)
        self.tie_projs = [bool(t) for t in self.tie_projs]
        if len(self.tie_projs) != n_clusters:
            raise ValueError(
                f"ModelConfig.tie_projs has {len(self.tie_projs)} entries but there are {n_clusters} "
                f"clusters (len(cutoffs) + 1); give one flag per cluster")
        if self.attn_type not in typing.get_args(AttnType):
            raise ValueError(
                f"ModelConfig.attn_type={self.attn_type!r} is unknown; choose one of "
                f"{', '.join(typing.get_args(AttnType))}")
        if self.attn_type == "rotary" and self.d_head % 2:
            raise ValueError(f"ModelConfig.attn_type='rotary' rotates pairs of channels: d_head={self.d_head} must be "
                             "even; choose n_head so that d_model // n_head is even, or set d_head")
        if self.same_length_style not in typing.get_args(SameLengthStyle):
            raise ValueError(
                f"ModelConfig.same_length_style={self.same_length_style!r} is unknown; choose 'pytorch' "
                "(original PyTorch / Hugging Face) or 'tensorflow' (original TensorFlow / NVIDIA)")
        self._check_compressive()
        if self.same_length and self.mem_len == 0:  # the first query of every segment would see no key
            raise ValueError("ModelConfig.same_length with mem_len=0 masks every key of a segment's first query "
                             "(its loss is NaN): set mem_len >= 1, or same_length false")

    def _check_compressive(self) -> None:
        """The compressed memory's fields, and the options it cannot be combined with (yet)."""
        for name in ("cmem_len", "cmem_rate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "cmem_len" else 1):
                raise ValueError(f"ModelConfig.{name}={value!r} must be an integer >= {0 if name == 'cmem_len' else 1}")
        if self.cmem_fn not in typing.get_args(CompressFn):
            raise ValueError(f"ModelConfig.cmem_fn={self.cmem_fn!r} is unknown; choose one of "
                             f"{', '.join(map(repr, typing.get_args(CompressFn)))}")
        if self.mem_len + self.cmem_len > MAX_MEMORY_ROWS:
            # Every query attends over every kept row: a (B, H, T, K) score tensor per layer and segment, and a
            # compressed memory far past what a run can fill grows (and slows every step) without end.
            raise ValueError(f"ModelConfig.mem_len={self.mem_len} + cmem_len={self.cmem_len} keeps "
                             f"{self.mem_len + self.cmem_len:,} rows per layer, each attended by every query: at most "
                             f"{MAX_MEMORY_ROWS:,}; choose cmem_len of the order of mem_len (each slot stands for "
                             f"cmem_rate={self.cmem_rate} states already)")
        if not self.cmem_len:
            return
        if self.mem_len == 0:
            raise ValueError(f"ModelConfig.cmem_len={self.cmem_len} compresses the states leaving the memory, and "
                             "mem_len=0 keeps none: set mem_len >= 1, or cmem_len 0")
        if self.same_length:
            raise ValueError("ModelConfig.same_length hides all but the last mem_len keys, the compressed slots among "
                             "them: set same_length false with cmem_len > 0")
        if self.ext_len:
            raise ValueError("ModelConfig.ext_len re-feeds rows that the compressed memory would hold twice: set "
                             "ext_len 0 with cmem_len > 0")

    @property
    def n_clusters(self) -> int:
        """Number of tail clusters of the adaptive softmax (0 for a plain softmax)."""
        return len(self.cutoffs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict, rejecting unknown keys with a message that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        data, _ = split_compute(data)  # a config saved before issue 45: its how-fields are not the model's
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field(s) {unknown}{did_you_mean(unknown[0], known)}; known fields are "
                f"{sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def context(self, **changes: Any) -> Context:
        """The attention context this config trains with; ``changes`` (None: keep) give another one."""
        own = dict(mem_len=self.mem_len, clamp_len=self.clamp_len, same_length=self.same_length,
                   same_length_style=self.same_length_style, ext_len=self.ext_len)
        unknown = sorted(set(changes) - set(own))
        if unknown:
            raise ValueError(f"the context has no field(s) {unknown}; its fields are {sorted(own)} (the others "
                             "shape the parameters and cannot change after construction)")
        return Context(**{**own, **{k: v for k, v in changes.items() if v is not None}})


@dataclass(frozen=True, kw_only=True)
class Context:
    """The attention context of a forward pass: how far back it looks and how the keys are masked.

    These fields own no parameters, so a trained model can run in another context than its config's
    (Dai et al. 2019, section 3.2: evaluate with a longer memory than in training). Passed to
    ``TransformerXL.forward(context=)`` as the memory is; ``ModelConfig.context()`` is the default.
    """

    mem_len: int
    """Hidden states kept per layer for the next segment (0: no recurrence)."""
    clamp_len: int = -1
    """Relative distances beyond clamp_len share one encoding; <= 0 means no clamping."""
    same_length: bool = False
    """Every query attends to the same number of keys."""
    same_length_style: SameLengthStyle = "pytorch"
    """'pytorch' (each query sees mem_len keys) or 'tensorflow' (mem_len + 1); see ModelConfig."""
    ext_len: int = 0
    """Trailing tokens of each segment not written to memory (re-fed with the next segment)."""

    def __post_init__(self) -> None:
        for name in ("mem_len", "ext_len", "clamp_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or (value < 0 and name != "clamp_len"):
                need = "an integer" if name == "clamp_len" else "an integer >= 0"
                raise ValueError(f"Context.{name}={value!r} must be {need}")
        if self.same_length_style not in typing.get_args(SameLengthStyle):
            raise ValueError(f"Context.same_length_style={self.same_length_style!r} is unknown; choose 'pytorch' "
                             "or 'tensorflow'")
        if self.same_length and self.mem_len == 0:
            raise ValueError("same_length with mem_len 0 masks every key of a segment's first query: use a memory "
                             "of at least 1, or same_length false")

    def describe(self, *, mem_len: str | None = None, model: ModelConfig | None = None) -> str:
        """The context as printed beside a figure: 'mem_len 192, clamp_len 128, same_length' (a longer memory
        lowers the loss, Dai et al. 2019 section 4.3, so a figure without its context is not comparable).
        ``mem_len``: shown instead of the field (a sweep's lengths). ``model``: the model read in this context;
        a compressive one's second memory is named too ('cmem_len 16 at rate 4 (max)'), which every query reads."""
        parts = [f"mem_len {self.mem_len if mem_len is None else mem_len}"]
        if model is not None and model.cmem_len:
            parts.append(f"cmem_len {model.cmem_len} at rate {model.cmem_rate} ({model.cmem_fn})")
        if self.clamp_len > 0:
            parts.append(f"clamp_len {self.clamp_len}")
        if self.same_length:
            parts.append("same_length" + (" (tensorflow)" if self.same_length_style == "tensorflow" else ""))
        if self.ext_len:
            parts.append(f"ext_len {self.ext_len}")
        return ", ".join(parts)


@dataclass(kw_only=True)
class ComputeConfig:
    """How the model is computed, not what it is (``ModelConfig``): paths and kernels of the same numbers.

    The same numbers up to rounding, and another draw of the same dropout distribution ('dropout_impl'). A model
    resolves it for the device its parameters live on (``txl.model.plan.compute_plan``), and its forward reads that
    plan; a checkpoint stores its ``ModelConfig`` and loads under any compute config. A finished experiment run that
    differs from its config only here is the same run (experiments.common.train_or_skip)."""

    attn_impl: AttnImpl = "fused"
    """Which path computes the model; the numbers are the same up to rounding.
    'fused': the fast path (``txl.model.transformer``, its kernels in ``txl.model.kernels``): the fused kernel
    ``scaled_dot_product_attention`` with the positional scores as its additive mask, realigned without
    rel_shift's padded copy; in training a FlashAttention-style backward (see recompute_attention); the key/value
    cache's projected position table.
    'reference': the plain path (``txl.model.plain``): the whole model, embedding to softmax, in torch ops and nn
    modules as the paper writes it (no custom autograd Function, no kernel switch: dropout_impl, cluster_rows,
    softmax_pad, cast_weights and recompute_attention do not apply); the oracle every
    other path is tested against. Timings of both: benchmarks/README.md."""
    recompute_attention: bool = False
    """attn_impl='fused', training: recompute the attention scores in backward instead of keeping the
    (B, H, T, M+T) probabilities of every layer (192 MiB at the base benchmark shape; their size grows with
    the memory). No effect on the numbers; costs ~5% of a training step (benchmarks/README.md, phase
    train-recompute): turn it on when memory is short (long memories, large batches on a GPU). Ignored with
    dropatt > 0, whose dropped probabilities are kept."""
    dropout_impl: DropoutImpl = "fast"
    """How dropout masks are drawn (``txl.model.dropout``). 'fast': ``nn.Dropout``'s distribution (each element
    dropped independently with probability p, kept ones scaled by 1 / (1 - p)) drawn on CPU as the gaps between
    dropped elements, one draw per dropped element instead of one per element; torch's own kernel on other
    devices. 'torch': ``nn.Dropout`` itself (the draws ``F.dropout`` makes from the same seed)."""
    cluster_rows: ClusterRows = "auto"
    """Which rows each tail cluster of the adaptive input and softmax computes (``txl.model.adaptive``); the
    numbers are the same. 'selected': only the tokens that fall in it, found with ``nonzero`` (the least work,
    but a host sync per cluster on a GPU, and shapes that change with the batch). 'all': every token, the
    others masked out (static shapes, no sync: what torch.compile and CUDA graphs need; the tails' matmuls
    then cover every token: at NVIDIA's WikiText-103 shape about 6x the softmax's work). 'auto': 'selected'
    eagerly on the CPU, 'all' on other devices and under torch.compile (before issue 34: 'selected' eagerly
    on every device)."""
    cast_weights: CastWeights = "auto"
    """Under autocast, how the layers' float32 matmul weights and biases reach the compute dtype
    (``txl.model.casting``); the same numbers (the adaptive softmax's weights, biases and projections too, grouped
    in one op of their own, ``casting.cast_rows``; with 'per_use' it casts each once per forward). 'per_use':
    autocast casts each where it is used and backward casts each gradient back (two copy kernels per weight and
    step). 'grouped': all of them in one op at the start of the forward, their gradients in one at the end of
    backward (the gradients then all arrive after the last layer's: DDP could not overlap its all-reduce with
    backward). 'auto': 'grouped', except in a process group of more than one or with parameters that are not plain
    tensors (FSDP's); no effect without autocast."""
    softmax_pad: int = 0
    """Pad the width of each output matmul of the softmax (the head's shortlist + clusters, each tail
    cluster) up to a multiple of this, with zero weights and a -inf bias: log-probabilities unchanged, and a
    GPU's tensor-core kernels get the aligned widths they need (NVIDIA's 20,003-wide head ran a Turing-era
    kernel). 1: no padding. 0 (auto): 64 on CUDA, 1 elsewhere (on the CPU padding only adds work)."""

    def __post_init__(self) -> None:
        if not isinstance(self.softmax_pad, int) or isinstance(self.softmax_pad, bool) or self.softmax_pad < 0:
            raise ValueError(f"ComputeConfig.softmax_pad={self.softmax_pad!r} must be an integer >= 0 (0: auto, "
                             "1: no padding, 64: widths padded to multiples of 64)")
        for name, kind in (("attn_impl", AttnImpl), ("dropout_impl", DropoutImpl), ("cluster_rows", ClusterRows),
                           ("cast_weights", CastWeights)):
            _check_literal("ComputeConfig", self, name, kind)

    def replace(self, **changes: Any) -> ComputeConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


# -- training and evaluation ---------------------------------------------------------------------------

OptimizerName = Literal["adam", "adamw"]
Schedule = Literal["cosine", "inv_sqrt", "constant"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
LossPositions = Literal["all", "last_half"]
Parallel = Literal["ddp", "fsdp"]
TrainGraphs = Literal["auto", "step", "model", "off"]


def _check(cls: str, name: str, ok: bool, need: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{cls}.{name}={value!r} {need}")


def _check_literal(cls: str, obj: Any, name: str, kind: Any) -> None:
    value, choices = getattr(obj, name), typing.get_args(kind)
    if value not in choices:
        raise ValueError(f"{cls}.{name}={value!r} is unknown; choose one of {', '.join(map(repr, choices))}")


@dataclass(kw_only=True)
class DataConfig:
    """Which corpus to train on and how to tokenise it."""

    corpus: str = "stdlib"
    """A corpus name (enwik8, text8, wt103, wt2, ptb, pennchar, lm1b), a text file, a directory with
    train/valid/test.txt, 'stdlib': this Python's standard-library source (always available), or 'recall':
    generated key-value recall at known distances (txl.data.recall)."""
    data_dir: str | None = None
    """Folder holding a named corpus's files (default data/<name>)."""
    level: str | None = None
    """Tokenisation level override: byte, char, word or bpe (None: the corpus's own)."""
    cache_dir: str | None = None
    """Where token arrays are cached (default ~/.cache/txl/tokens)."""
    max_bytes: int = 4_000_000
    """'stdlib' only: how many bytes of source to read (90/5/5 % in train/valid/test, by file path hash)."""

    def __post_init__(self) -> None:
        _check("DataConfig", "corpus", isinstance(self.corpus, str) and bool(self.corpus), "must be a name or path",
               self.corpus)
        if self.level is not None and self.level not in ("byte", "char", "word", "bpe"):
            raise ValueError(f"DataConfig.level={self.level!r} is unknown; choose one of byte, char, word, bpe")
        _check("DataConfig", "max_bytes", self.max_bytes >= 1000, "must be at least 1000", self.max_bytes)


@dataclass(kw_only=True)
class OptimConfig:
    """The optimiser and the learning-rate schedule."""

    optimizer: OptimizerName = "adam"
    """'adam' (the paper) or 'adamw' (decoupled weight decay)."""
    lr: float = 2.5e-4
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay (the original's eta_min)."""
    schedule: Schedule = "cosine"
    """'cosine': linear warm-up then cosine decay to min_lr over train.max_steps;
    'inv_sqrt': linear warm-up then lr * sqrt(warmup / step); 'constant': warm-up then flat."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to lr."""
    weight_decay: float = 0.0
    """L2 penalty ('adam') or decoupled weight decay ('adamw')."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip: float = 0.25
    """Clip the global gradient norm to this value (<= 0: no clipping). The paper uses 0.25."""

    def __post_init__(self) -> None:
        _check_literal("OptimConfig", self, "optimizer", OptimizerName)
        _check_literal("OptimConfig", self, "schedule", Schedule)
        _check("OptimConfig", "lr", self.lr > 0, "must be positive", self.lr)
        _check("OptimConfig", "min_lr", 0 <= self.min_lr <= self.lr, "must lie in [0, lr]", self.min_lr)
        _check("OptimConfig", "warmup_steps", self.warmup_steps >= 0, "must be >= 0", self.warmup_steps)
        _check("OptimConfig", "weight_decay", self.weight_decay >= 0, "must be >= 0", self.weight_decay)
        for name in ("beta1", "beta2"):
            _check("OptimConfig", name, 0 <= getattr(self, name) < 1, "must lie in [0, 1)", getattr(self, name))
        _check("OptimConfig", "eps", self.eps > 0, "must be positive", self.eps)
        if self.schedule == "inv_sqrt" and self.warmup_steps == 0:
            raise ValueError("OptimConfig.schedule='inv_sqrt' needs warmup_steps > 0 (the decay is "
                             "lr * sqrt(warmup_steps / step)); set --optim.warmup_steps")


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: batches, precision, validation, checkpoints and logging."""

    out_dir: str = "runs/default"
    """Run directory: checkpoints, metrics.jsonl, TensorBoard events, the learning-curve plot."""
    max_steps: int = 1000
    """Optimiser steps to train for (also the horizon of the cosine schedule)."""
    minutes: float = 0.0
    """Stop after this many minutes of training, whatever the step (0: no time limit)."""
    batch_size: int = 16
    """Global batch: parallel token streams over all processes and accumulation chunks."""
    grad_accum: int = 1
    """Split each process's streams into this many chunks, each with its own memory, and accumulate."""
    tgt_len: int = 128
    """Tokens per segment (the paper's target length)."""
    var_len: bool = False
    """Vary the segment length as the original training script does."""
    seed: int = 0
    """Seeds the weights, dropout and the segment lengths."""
    precision: Precision = "auto"
    """'auto' (bf16 on a CUDA GPU that supports it, else fp32); 'fp32'; 'bf16' autocast (CPU and GPU);
    'fp16' autocast with a gradient scaler (CUDA only). Evaluation during and after training uses it too."""
    tf32: bool = True
    """On CUDA, let fp32 matmuls use TF32 tensor cores for this run (fp32 range, 10-bit mantissa products;
    several times faster on Ampere and later). False: exact fp32 products. No effect on a CPU."""
    compile: bool = False
    """Run the training forward and backward through torch.compile (the first steps pay the compilation;
    the model and its checkpoints are unchanged)."""
    graphs: TrainGraphs | bool = "auto"
    """How much of a training step is one CUDA graph (``txl.step_graph``, ``txl.graphs``):

    * 'step': the whole step (forward, backward, clipping, the optimiser's step, the memory handed on) captured
      once and replayed, its inputs, labels and memory in static buffers written in place (on a CPU: the same
      static-shape step compiled, nothing to capture);
    * 'model': only the forward and backward, through torch.compile(mode='reduce-overhead'), the optimiser outside;
    * 'off': kernel by kernel (``compile`` applies);
    * 'auto' (the default): 'step' on CUDA, 'off' elsewhere (``txl.model.plan``'s table); a run the captured step
      does not fit (another encoding, ext_len, var_len, a compressed memory, several processes, FSDP,
      activation checkpointing) runs as before, with one log line saying why.

    Static shapes: the memory always holds mem_len rows, those not filled yet hidden. true and false (the older
    boolean) mean 'model' and 'off'. The first steps pay the compilation and the capture."""
    loss_positions: LossPositions = "all"
    """Segment positions the training loss is taken on: 'all' (the paper's 'Full' loss) or 'last_half'
    ('Half': the cross-entropy only on the last half of the positions of each training segment, as Al-Rfou
    et al. 2018 train, so every scored position has at least half a segment of context; Dai et al. 2019,
    Table 6). Validation and test always score every position; the training log's token counts are of
    scored positions."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N'."""
    eval_interval: int = 200
    """Validate every this many steps (0: only at the end)."""
    eval_batches: int = 50
    """Validation segments per periodic evaluation (0: the whole split). The final one uses all."""
    ckpt_interval: int = 200
    """Write a checkpoint every this many steps (0: only at validations and the end)."""
    keep_last: int = 3
    """Step checkpoints kept besides the best one."""
    log_interval: int = 10
    """Write a metrics row every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard events when the tensorboard package is installed (pip install 'txl[tb]')."""
    plot: bool = True
    """Write learning_curve.png at the end when matplotlib is installed."""
    progress: bool = True
    """Show a tqdm progress bar."""
    sample_tokens: int = 0
    """After training, print a continuation of this many tokens of a test prompt (0: none)."""
    parallel: Parallel = "ddp"
    """How a torchrun job of several processes shares the model (txl.parallel): 'ddp' (a full copy per
    process, gradients all-reduced; checkpoints are model directories) or 'fsdp' (FSDP2 fully_shard per
    decoder layer, then embedding and softmax, then the root: parameters, gradients and optimiser state
    sharded; checkpoints are sharded torch.distributed.checkpoint directories that resume at any process
    count). One process trains the same either way."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (less
    memory, about one more forward of compute); the result is the same."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum", "tgt_len", "keep_last", "log_interval"):
            value = getattr(self, name)
            _check("TrainConfig", name, isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   "must be a positive integer", value)
        for name in ("eval_interval", "eval_batches", "ckpt_interval", "sample_tokens"):
            _check("TrainConfig", name, getattr(self, name) >= 0, "must be >= 0", getattr(self, name))
        _check("TrainConfig", "minutes", self.minutes >= 0, "must be >= 0", self.minutes)
        _check_literal("TrainConfig", self, "precision", Precision)
        _check_literal("TrainConfig", self, "loss_positions", LossPositions)
        _check_literal("TrainConfig", self, "parallel", Parallel)
        if isinstance(self.graphs, bool):  # the older boolean field: true was the forward and backward's graphs
            self.graphs = "model" if self.graphs else "off"
        _check_literal("TrainConfig", self, "graphs", TrainGraphs)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"TrainConfig.device={self.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")


@dataclass(kw_only=True)
class EvalConfig:
    """The evaluation context. None means 'as in training'; the paper evaluates with longer memory."""

    batch_size: int = 10
    """Parallel streams (the original evaluates with 10; 1 reads the split as one stream)."""
    tgt_len: int | None = None
    """Tokens per segment."""
    mem_len: int | None = None
    """Memory length; longer than in training is what Transformer-XL is for."""
    clamp_len: int | None = None
    """Relative distances beyond this share one encoding (<= 0: none)."""
    same_length: bool | None = None
    """Every query attends to the same number of keys."""
    ext_len: int | None = None
    """Extended context re-fed from the previous segment."""
    compile: bool = False
    """Evaluate through torch.compile (validation during training and the final test)."""
    graphs: bool = False
    """Evaluate (and ``txl score``) with each segment captured as one CUDA graph over key/value rings written in place
    (``txl.static_eval``; compiled on a CPU), or at one static shape (``txl.graphs``) where the rings do not apply."""

    def __post_init__(self) -> None:
        _check("EvalConfig", "batch_size", self.batch_size >= 1, "must be a positive integer", self.batch_size)
        if self.compile and self.graphs:
            raise ValueError("EvalConfig.compile and EvalConfig.graphs are both set: graphs already compiles (static "
                             "shapes through torch.compile's CUDA graphs); set one of them")
        if self.tgt_len is not None:
            _check("EvalConfig", "tgt_len", self.tgt_len >= 1, "must be a positive integer", self.tgt_len)
        for name in ("mem_len", "ext_len"):
            value = getattr(self, name)
            if value is not None:
                _check("EvalConfig", name, value >= 0, "must be >= 0", value)

    def context(self, model: ModelConfig) -> Context:
        """The attention context evaluation runs in, the one rule every command and the trainer apply: each
        field left unset (None) is the model's, as in training; the model's config is never changed."""
        return model.context(mem_len=self.mem_len, clamp_len=self.clamp_len, same_length=self.same_length,
                             ext_len=self.ext_len)

    def segment_len(self, trained: int) -> int:
        """Tokens per evaluation segment: tgt_len, or the training segment length ``trained`` when unset."""
        return self.tgt_len or trained


def check_sampling(*, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   repetition_penalty: float | None = None) -> None:
    """The one check of the sampling arguments (None: not given), each with the message that names it.

    ``SampleConfig`` (the command line and presets) and the public entry points of ``txl.sampling`` and
    ``txl.generation`` call it once; the work below them runs unchecked. Torch-free, so a typo is refused
    before a model is loaded.
    """
    if temperature is not None and not (isinstance(temperature, (int, float)) and temperature >= 0):  # NaN too
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0 means greedy: the most likely token)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 keeps every token)")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 keeps every token)")
    if repetition_penalty is not None and not (isinstance(repetition_penalty, (int, float)) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty={repetition_penalty!r} must be > 0 (1 disables it; CTRL uses 1.2)")


@dataclass(kw_only=True)
class SampleConfig:
    """Sampling: `txl generate`'s settings (a run's own are its defaults) and the end-of-training sample."""

    max_new_tokens: int = 100
    """Tokens to generate (`txl generate`; the end-of-training sample has train.sample_tokens)."""
    temperature: float = 1.0
    """Divides the logits: below 1 sharpens the distribution, above 1 flattens it; 0 is greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens holding this probability mass (1: all)."""
    repetition_penalty: float = 1.0
    """Above 1 lowers the scores of tokens already read or written (CTRL, Keskar et al. 2019, uses 1.2; 1: off)."""
    seed: int | None = None
    """Random seed, for reproducible samples (none: a fresh draw each time; the end-of-training sample
    uses train.seed)."""
    stop: list[str] = field(default_factory=list)
    """Stop when the output contains one of these texts, cutting before it."""
    mem_len: int | None = None
    """Memory while generating (none: keep the whole context, prompt included, up to the model's positions)."""
    segment_len: int = 256
    """Prompt tokens read per forward pass."""
    compile: bool = False
    """Run each generation step as one torch.compile graph (``txl.compiled_step``, relative attention; other
    encodings and a compressed memory: the whole forward through torch.compile)."""

    def __post_init__(self) -> None:
        check_sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                       repetition_penalty=self.repetition_penalty)
        _check("SampleConfig", "max_new_tokens", self.max_new_tokens >= 0, "must be >= 0", self.max_new_tokens)
        _check("SampleConfig", "segment_len", self.segment_len >= 1, "must be a positive integer", self.segment_len)
        if self.mem_len is not None:
            _check("SampleConfig", "mem_len", self.mem_len >= 1, "must be >= 1 (none: the whole context)",
                   self.mem_len)
        if any(not s for s in self.stop):
            raise ValueError("SampleConfig.stop holds an empty text; every stop text needs at least one character")


SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "compute": ComputeConfig, "optim": OptimConfig,
                             "train": TrainConfig, "eval": EvalConfig, "sample": SampleConfig}


MACHINE_KEY = "machine"  # run.json also records where the run ran (txl.runtime.machine_record); never config


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs, saved with every checkpoint. model.vocab_size is the corpus's."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def __post_init__(self) -> None:
        m, t = self.model, self.train
        if m.ext_len and m.ext_len >= t.tgt_len:
            raise ValueError(f"model.ext_len={m.ext_len} must be shorter than train.tgt_len={t.tgt_len}")
        # Batch divisibility and fp16-needs-CUDA depend on the process count and the resolved device:
        # txl.train.check_run checks them once, when the run starts.

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build from nested dicts of typed values ({'model': {...}, ...}), as ``to_dict`` writes them;
        unknown sections or fields are errors. Text (a TOML file, command-line strings) goes through
        ``txl.presets``, which types each value first."""
        unknown = sorted(set(data) - set(SECTIONS) - {MACHINE_KEY})  # run.json's record of the machine: not config
        if unknown:
            raise ValueError(f"unknown config section(s) {unknown}; valid sections are {sorted(SECTIONS)}")
        data = dict(data)
        if isinstance(data.get("model"), dict):  # a run saved before issue 45: its how-fields move to [compute]
            data["model"], moved = split_compute(data["model"])
            if isinstance(data.get("compute", {}), dict):
                data["compute"] = {**moved, **data.get("compute", {})}
        sections = {}
        for name, kind in SECTIONS.items():
            values = data.get(name, {})
            if not isinstance(values, dict):
                raise ValueError(f"config section [{name}] must be a table of fields")
            known = {f.name for f in dataclasses.fields(kind)}
            values = retire(values) if name == "compute" else dict(values)
            bad = sorted(set(values) - known)
            if bad:
                raise ValueError(f"unknown field(s) {', '.join(f'{name}.{b}' for b in bad)}"
                                 f"{did_you_mean(bad[0], known)}; valid {name} "
                                 f"fields are: {', '.join(sorted(known))}")
            if name == "model":
                values.setdefault("vocab_size", 256)
            sections[name] = kind(**values)
        return cls(**sections)

    def replace(self, **sections: Any) -> RunConfig:
        return dataclasses.replace(self, **sections)
