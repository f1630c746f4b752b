"""Build the reference Hugging Face TransfoXLLMHeadModel and convert it to ours.

The oracle (``transformers==4.37.2``) pins an old huggingface_hub and tokenizers, so it lives in its own
environment (``.ci/run`` builds it and runs ``pytest -m oracle`` there), not in ``.[dev]``: a test that
builds it is marked ``oracle`` and skips where transformers is not installed."""

from __future__ import annotations

import pytest
import torch

import txl
from txl.convert import config_from_hf, state_dict_from_hf
from txl.pretrained import load_weights


def hf_model(**overrides):
    """A small random TransfoXLLMHeadModel; every parameter perturbed so biases and norms matter."""
    pytest.importorskip("transformers", reason="the oracle transformers==4.37.2 is not installed (.ci/run's "
                        "oracle environment: pip install -e '.[dev,oracle]')")
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    kwargs = dict(vocab_size=97, cutoffs=[20, 50], d_model=32, d_embed=32, n_head=4, d_head=8, d_inner=64,
                  div_val=1, pre_lnorm=False, n_layer=3, mem_len=12, clamp_len=-1, same_length=False,
                  untie_r=True, dropout=0.0, dropatt=0.0, tie_projs=[False, True, True])
    kwargs.update(overrides)
    config = TransfoXLConfig(**kwargs)
    torch.manual_seed(1)
    model = TransfoXLLMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.crit.keep_order = True  # per-token losses in token order, to compare with ours
    return model


def ours_from_hf(model) -> txl.TransformerXL:
    config = config_from_hf(model.config.to_dict())
    ours = txl.TransformerXL(config)
    load_weights(ours, state_dict_from_hf(model.state_dict()), source="test")
    return ours.eval()
