"""Checkpoints: our format round trip, Hugging Face import and export, the published configuration."""

import json

import pytest
import torch
from conftest import tiny_config
from hf_oracle import hf_model

import txl
from txl.convert import config_from_hf, state_dict_from_hf, state_dict_to_hf
from txl.pretrained import load_weights, tied_keys

# Adaptive clusters of two widths: the tied embedding/softmax pairs and projections are what files must keep.
ADAPTIVE = dict(cutoffs=[20, 40], div_val=2)
V = tiny_config().vocab_size


def outputs(model, tokens):
    with torch.no_grad():
        out = model(tokens, memory=model.init_memory(tokens.size(0), model.config.mem_len))
    return out.log_probs


def test_round_trip_reproduces_outputs_and_stores_tied_weights_once(tmp_path):
    model = txl.TransformerXL(tiny_config(**ADAPTIVE)).eval()
    txl.save_pretrained(model, tmp_path)
    loaded = txl.from_pretrained(tmp_path)
    tokens = torch.randint(0, V, (2, 6))
    assert torch.equal(outputs(model, tokens), outputs(loaded, tokens))
    assert loaded.config == model.config
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "embed.layers.1.weight" in keys and "softmax.layers.1.weight" not in keys
    # Ties survive loading: the output layer is the embedding.
    assert loaded.softmax.layers[1].weight is loaded.embed.layers[1].weight
    assert loaded.softmax.projs[1] is loaded.embed.projs[1]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.oracle
def test_import_hf_directory_saved_by_transformers(tmp_path):
    hf = hf_model(div_val=2, d_embed=32, cutoffs=[20, 50])
    for safe in (True, False):
        directory = tmp_path / f"hf_{safe}"
        hf.save_pretrained(directory, safe_serialization=safe)
        ours = txl.from_pretrained(directory)
        tokens = torch.randint(0, 97, (2, 6))
        with torch.no_grad():
            ref = hf(input_ids=tokens).prediction_scores
        torch.testing.assert_close(outputs(ours, tokens), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.oracle
def test_export_to_hf_is_loaded_by_transformers(tmp_path):
    from transformers import TransfoXLLMHeadModel

    model = txl.TransformerXL(tiny_config(**ADAPTIVE, untie_r=True)).eval()
    txl.save_hf(model, tmp_path)
    hf = TransfoXLLMHeadModel.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, V, (2, 6))
    with torch.no_grad():
        ref = hf(input_ids=tokens).prediction_scores
    torch.testing.assert_close(outputs(model, tokens), ref, atol=1e-5, rtol=1e-5)


def test_export_refuses_what_hf_cannot_express(tmp_path):
    model = txl.TransformerXL(tiny_config(**ADAPTIVE, attn_type="shaw"))
    with pytest.raises(ValueError, match="attn_type='shaw' cannot be exported"):
        txl.save_hf(model, tmp_path)


@pytest.mark.oracle
def test_published_wt103_configuration_every_key_every_shape_round_trip():
    """transfo-xl-wt103 with random weights: vocab 267,735, cutoffs 20k/40k/200k, div_val 4, 18 x 1024."""
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    hf_config = TransfoXLConfig()  # its defaults are the published configuration
    assert (hf_config.vocab_size, hf_config.cutoffs, hf_config.div_val, hf_config.n_layer) == (
        267735, [20000, 40000, 200000], 4, 18)
    with torch.device("meta"):
        hf = TransfoXLLMHeadModel(hf_config)
    # The published file stores every parameter, tied ones included; fill each with random values.
    gen = torch.Generator().manual_seed(0)
    hf_state = {}
    for key, t in hf.state_dict().items():
        hf_state[key] = torch.rand(t.shape, generator=gen, dtype=torch.float32)
    # Tied tensors hold the same values in a real checkpoint.
    for i in range(4):
        hf_state[f"crit.out_layers.{i}.weight"] = hf_state[f"transformer.word_emb.emb_layers.{i}.weight"]
        if hf_config.tie_projs[i]:
            hf_state[f"crit.out_projs.{i}"] = hf_state[f"transformer.word_emb.emb_projs.{i}"]
    config = config_from_hf(hf_config.to_dict())
    assert (config.d_model, config.n_head, config.d_head, config.d_inner) == (1024, 16, 64, 4096)
    assert config.untie_r and config.tie_projs == [False, True, True, True]
    with torch.device("meta"):
        ours = txl.TransformerXL(config)
    load_weights(ours, state_dict_from_hf(hf_state), source="wt103")  # strict: every key consumed
    assert not any(p.is_meta for p in ours.parameters())
    back = state_dict_to_hf(ours.state_dict())
    assert set(back) == set(hf_state) - {"transformer.pos_emb.inv_freq"}
    for key, tensor in back.items():
        assert torch.equal(tensor, hf_state[key]), key
    n_params = sum(p.numel() for p in ours.parameters())
    assert 280e6 < n_params < 290e6  # the published model has about 285M parameters


def test_config_and_weights_that_disagree(tmp_path):
    model = txl.TransformerXL(tiny_config(**ADAPTIVE))
    txl.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    d_inner = config["model"]["d_inner"]
    config["model"]["d_inner"] = d_inner + 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"layers\.0\.ff\.fc1\.\w+ has shape \({d_inner}.*\) but the config needs "
                                         rf"\({d_inner + 16}"):
        txl.from_pretrained(tmp_path)
    config["model"]["d_inner"] = d_inner
    config["model"]["n_layer"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weights and config disagree: missing \['layers.2"):
        txl.from_pretrained(tmp_path)


def test_corrupt_and_truncated_checkpoints(tmp_path):
    model = txl.TransformerXL(tiny_config(**ADAPTIVE))
    txl.save_pretrained(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        txl.from_pretrained(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        txl.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        txl.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        txl.from_pretrained(tmp_path / "nope")


@pytest.mark.oracle
def test_legacy_bin_is_loaded_without_unpickling_code(tmp_path):
    hf = hf_model()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    assert txl.from_pretrained(tmp_path).config.vocab_size == 97

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="holds Python objects other than tensors") as err:
        txl.from_pretrained(tmp_path)
    assert "weights_only" not in str(err.value)  # never torch's advice to unpickle anyway


@pytest.mark.oracle
def test_tied_weights_that_differ_in_the_file_are_rejected():
    hf = hf_model()
    state = hf.state_dict()
    state["crit.out_layers.0.weight"] = state["crit.out_layers.0.weight"] + 1
    ours = txl.TransformerXL(config_from_hf(hf.config.to_dict()))
    with pytest.raises(ValueError, match="differs from embed.layers.0.weight, but the config ties them"):
        load_weights(ours, state_dict_from_hf(state), source="test")


@pytest.mark.oracle
def test_unknown_checkpoint_keys_are_named():
    hf = hf_model()
    state = {**hf.state_dict(), "transformer.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"1 key\(s\) that are not part.*transformer.extra.weight"):
        state_dict_from_hf(state)


@pytest.mark.oracle
def test_original_pytorch_cluster_order_is_reversed_on_import():
    """The original PyTorch code scores tail cluster i with head column -i; ours with shortlist + i - 1."""
    hf = hf_model(cutoffs=[20, 50, 80], tie_projs=[False, True, True, True])
    state = hf.state_dict()
    ours = state_dict_from_hf(state, cluster_order="original_pytorch")
    torch.testing.assert_close(ours["softmax.cluster_weight"], state["crit.cluster_weight"].flip(0))
    # Original PyTorch: cluster i uses head column -i, i.e. row C - i of cluster_weight (0-based).
    C = 3
    for i in range(1, C + 1):
        torch.testing.assert_close(ours["softmax.cluster_weight"][i - 1], state["crit.cluster_weight"][C - i])


def test_tied_keys_lists_aliases():
    model = txl.TransformerXL(tiny_config(**ADAPTIVE))
    aliases = tied_keys(model)
    assert aliases["softmax.layers.0.weight"] == "embed.layers.0.weight"
    assert aliases["softmax.projs.1"] == "embed.projs.1" and "softmax.projs.0" not in aliases
