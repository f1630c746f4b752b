"""Fine-tuning: a training run that starts from a txl or Hugging Face checkpoint.

``txl train --init-from DIR|REPO_ID`` keeps what the checkpoint's weights depend on and takes everything
else from the command line:

* the **architecture** is the checkpoint's: a ``--model.*`` override of a field that shapes the parameters
  or what they compute (n_layer, d_model, cutoffs, attn_type, pre_ln, ...) is refused, naming the field;
  the context and regularisation fields may change (``CONTEXT_FIELDS``: mem_len, clamp_len, dropout, ...);
* the **vocabulary and tokenizer** are the checkpoint's: the new corpus is encoded with them (a txl
  checkpoint's saved tokenizer; a Hugging Face transfo-xl checkpoint's word vocabulary with the
  WikiText-103 rules, ``<eos>`` per line; the registry's pretokenized word corpora are split on
  whitespace), never with a vocabulary built from the new corpus, and saved with every checkpoint. A
  corpus or ``--data.level`` of another level than the checkpoint's tokenizer is refused;
* data, optimiser, schedule, training and evaluation settings are the preset's (``--preset``, default
  'default') with the overrides, as for any run, but the preset's evaluation *context* (``eval.mem_len``,
  ``clamp_len``, ``same_length``, ``ext_len``): it was sized for the preset's own model (the default's
  eval.mem_len 192 is 3x its training memory of 64), so a fine-tune evaluates in its own context (the
  checkpoint's, with the --model.* context overrides: mem_len 150 tests with 150) unless --eval.* says otherwise.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from txl.config import ModelConfig, RunConfig
from txl.data.corpora import Corpus, get_spec, resolve_sources
from txl.data.tokenizer import Tokenizer, WordTokenizer, encode_source, load_model_tokenizer
from txl.model import TransformerXL
from txl.presets import apply_overrides

log = logging.getLogger(__name__)

EVAL_CONTEXT_FIELDS = frozenset({"mem_len", "clamp_len", "same_length", "ext_len"})
"""The [eval] fields of an evaluation context: a preset's belong to the preset's model, not to a checkpoint's."""
CONTEXT_FIELDS = frozenset({"mem_len", "ext_len", "clamp_len", "same_length", "same_length_style", "dropout",
                            "dropatt", "init_std", "proj_init_std"})
"""Model fields a fine-tuning run may change: they own no parameters and do not change what the trained
weights compute, only the context they see or the regularisation (how it is computed, ``[compute]``, is the run's
own)."""


@dataclass
class Init:
    """What a fine-tuning run starts from."""

    directory: Path
    model: TransformerXL
    tokenizer: Tokenizer


def load_init(path: str | os.PathLike, *, revision: str | None = None, vocab: str | os.PathLike | None = None) -> Init:
    """The model and tokenizer of a txl checkpoint / run directory or a Hugging Face directory / Hub repo
    (``vocab``: a vocabulary file instead of the checkpoint's)."""
    from txl.pretrained import from_pretrained, resolve_model_dir

    directory = resolve_model_dir(path, revision=revision)
    model = from_pretrained(directory)
    # A txl checkpoint's saved tokenizer, or a Hugging Face vocabulary with the WikiText-103 rules.
    tokenizer = load_model_tokenizer(directory, vocab_size=model.config.vocab_size, vocab_file=vocab)
    return Init(directory=directory, model=model, tokenizer=tokenizer)


def check_architecture(pretrained: ModelConfig, requested: ModelConfig) -> None:
    """Raise naming the first architecture field ``requested`` changes (CONTEXT_FIELDS may change)."""
    for name, value in pretrained.to_dict().items():
        if name in CONTEXT_FIELDS or getattr(requested, name) == value:
            continue
        raise ValueError(f"--model.{name} {getattr(requested, name)!r} changes the architecture of the checkpoint "
                         f"(model.{name} = {value!r}); fine-tuning keeps it. Only these model fields may change: "
                         f"{', '.join(sorted(CONTEXT_FIELDS))}")


def run_config(base: dict[str, Any], overrides: dict[str, Any], init: Init) -> RunConfig:
    """The run's config: ``base`` (a preset) with the checkpoint's model section, then ``overrides``."""
    # The preset's tokenisation level is not the checkpoint's concern: only an explicit --data.level is checked;
    # nor is its evaluation context, sized for the preset's model (module docstring).
    evaluation = {k: v for k, v in base.get("eval", {}).items() if k not in EVAL_CONTEXT_FIELDS}
    data = {**base, "data": {**base.get("data", {}), "level": None}, "eval": evaluation,
            "model": init.model.config.to_dict()}
    cfg = RunConfig.from_dict(apply_overrides(data, overrides))
    check_architecture(init.model.config, cfg.model)
    level = init.tokenizer.spec["level"]
    if cfg.data.level is not None and cfg.data.level != level:
        raise ValueError(f"--data.level {cfg.data.level} differs from the checkpoint's tokenizer ({level} level); "
                         "fine-tuning encodes the corpus with the checkpoint's tokenizer: drop --data.level")
    return cfg


def encode_corpus(cfg: RunConfig, tokenizer: Tokenizer) -> Corpus:
    """The run's corpus (a registry name, a file or a train/valid/test directory) encoded with ``tokenizer``."""
    from txl.data.cache import default_cache_dir
    from txl.data.corpora import STDLIB_SEED
    from txl.data.stdlib import build_stdlib_corpus

    level = tokenizer.spec["level"]
    corpus = cfg.data.corpus
    spec, named = get_spec(corpus)
    if not named:  # a user file or folder: read at the checkpoint's level
        spec, _ = get_spec(corpus, level=level)
    if named and spec.level != level:
        raise ValueError(f"corpus {spec.name!r} is {spec.level} level but the checkpoint's tokenizer is {level} "
                         "level: fine-tune on a corpus of the checkpoint's level (or a text file / folder)")
    root = Path(cfg.data.data_dir) if cfg.data.data_dir else Path("data") / spec.name
    if spec.generated == "stdlib":
        cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
        root = build_stdlib_corpus(cache.parent / "stdlib", max_bytes=cfg.data.max_bytes, seed=STDLIB_SEED)
    sources = resolve_sources(spec, root if named else Path("/"))
    # The registry's word corpora are pretokenized (WikiText, PTB): split on whitespace, not re-tokenised.
    encoder = tokenizer.with_rules("whitespace") if named and isinstance(tokenizer, WordTokenizer) else tokenizer
    arrays = {}
    for split, srcs in sources.items():
        chunks = [chunk for s in srcs for chunk in encode_source(encoder, s)]
        arrays[split] = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        if not len(arrays[split]):
            raise ValueError(f"the {split} split of {spec.name!r} is empty")
    unk = getattr(getattr(tokenizer, "vocab", None), "unk_id", None)
    if unk is not None:
        share = float(np.mean(arrays["train"] == unk))
        log.info("fine-tuning corpus %s: %.2f%% of the train tokens are <unk> in the checkpoint's vocabulary",
                 spec.name, 100 * share)
    metric = "bpc" if level in ("byte", "char") else "ppl"
    return Corpus(name=spec.name, spec=spec, tokenizer=tokenizer, metric=metric, path=root, cached=False, **arrays)
