"""Bad input gets a ValueError that names the field and says how to fix it."""

import pytest
import torch
from conftest import tiny_config

import txl

V = tiny_config().vocab_size  # 61, d_model 32, 2 layers: the messages below name them


@pytest.mark.parametrize("overrides, match", [
    (dict(n_head=3, d_head=None), r"n_head=3 does not divide d_model=32.*set d_head"),  # d_head derived
    (dict(cutoffs=[20, 10]), r"cutoffs=\[20, 10\] must be strictly increasing"),
    (dict(cutoffs=[10, V]), rf"cutoffs=\[10, {V}\] must all be below vocab_size={V}"),
    (dict(cutoffs=[10], tie_projs=[True]), r"tie_projs has 1 entries but there are 2 clusters"),
    (dict(attn_type="nope"), r"attn_type='nope' is unknown; choose one of relative, shaw"),
    (dict(same_length_style="jax"), r"same_length_style='jax' is unknown"),
    (dict(dropout=1.5), r"dropout=1.5 must be in \[0, 1\)"),
    (dict(mem_len=-1), r"mem_len=-1 must be an integer >= 0"),
    (dict(d_model=33, n_head=3, d_head=None), r"d_model=33 must be even"),
    (dict(div_val=8, cutoffs=[10, 20], d_embed=32), r"div_val=8 leaves the last cluster"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_unknown_config_key():
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['n_layers'\] \(did you mean n_layer\?\)"):
        txl.ModelConfig.from_dict({**vars(tiny_config()), "n_layers": 3})


@pytest.fixture
def model():
    return txl.TransformerXL(tiny_config()).eval()


def test_token_ids_out_of_range(model):
    with pytest.raises(ValueError, match=f"token id {V} is out of range for vocab_size={V}"):
        model(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="a label is out of range"):
        model(torch.tensor([[1, 2]]), labels=torch.tensor([[3, 99]]))


def test_input_shape_errors(model):
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, T\) integer tensor.*unsqueeze"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="input_ids must be"):
        model(torch.rand(1, 3))
    with pytest.raises(ValueError, match="empty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="labels shape"):
        model(torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2, 3]]))


def test_memory_errors(model):
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="memory has 1 layers but the model has n_layer=2"):
        model(x, memory=(torch.zeros(1, 4, 32),))
    with pytest.raises(ValueError, match=r"memory\[1\] has shape \(1, 4, 16\).*transpose"):
        model(x, memory=(torch.zeros(1, 4, 32), torch.zeros(1, 4, 16)))
    with pytest.raises(ValueError, match=r"memory\[0\] has shape \(4, 1, 32\)"):  # sequence-first (HF style)
        model(x, memory=(torch.zeros(4, 1, 32), torch.zeros(4, 1, 32)))
    with pytest.raises(ValueError, match="memory must be a tuple"):
        model(x, memory=torch.zeros(1, 4, 32))


def test_ext_len_longer_than_segment():
    m = txl.TransformerXL(tiny_config(ext_len=3))
    with pytest.raises(ValueError, match="ext_len=3 must be shorter than the segment"):
        m(torch.tensor([[1, 2, 3]]))
