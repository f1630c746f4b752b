"""Typed, validated configuration of the Transformer-XL language model.

Configs are plain data (no callables) so they serialise to JSON and travel with every checkpoint.
Each option of the paper is a named field; combinations that cannot work are rejected in
``__post_init__`` with a message that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

AttnType = Literal["relative", "shaw", "absolute", "al_rfou"]
SameLengthStyle = Literal["pytorch", "tensorflow"]


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

    # Positional encoding: the paper's (relative) and its Table 6 ablations.
    attn_type: AttnType = "relative"
    """'relative': the paper's encoding, terms (a)+(b)+(c)+(d) with sinusoidal R and biases u, v.
    'shaw': Shaw et al. 2018, a learned embedding per relative distance.
    'absolute': Vaswani et al. 2017, sinusoid added to the input.
    'al_rfou': Al-Rfou et al. 2018, a learned absolute embedding added to every layer's input."""
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
        self.cutoffs = [int(c) for c in self.cutoffs]
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
        if self.same_length_style not in typing.get_args(SameLengthStyle):
            raise ValueError(
                f"ModelConfig.same_length_style={self.same_length_style!r} is unknown; choose 'pytorch' "
                "(original PyTorch / Hugging Face) or 'tensorflow' (original TensorFlow / NVIDIA)")

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
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)
