"""The Hugging Face `transfo-xl` layout (TransfoXLLMHeadModel, e.g. `transfo-xl-wt103`) <-> ours.

Traps this module handles:
- Hugging Face (like the TensorFlow original) scores tail cluster i with head column
  shortlist + i - 1; the original PyTorch code reads column -i (cluster rows reversed):
  ``cluster_order="original_pytorch"`` reorders such checkpoints on import.
- Hugging Face memory is sequence-first (M, B, d) and starts as zeros that are attended to; ours is
  batch-first and starts empty (use ``model.init_memory(B, mem_len)`` for the zeros).
- Hugging Face ``labels`` are shifted inside each segment (T - 1 losses); ours are already shifted.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import torch

from txl.config import ModelConfig

ClusterOrder = Literal["hf", "original_pytorch"]

# (Hugging Face key, our key) templates: {l} layer, {i} cluster, {p} weight or bias.
_KEY_MAP: list[tuple[str, str]] = [
    ("transformer.word_emb.emb_layers.{i}.weight", "embed.layers.{i}.weight"),
    ("transformer.word_emb.emb_projs.{i}", "embed.projs.{i}"),
    ("transformer.r_w_bias", "u"),
    ("transformer.r_r_bias", "v"),
    ("transformer.layers.{l}.dec_attn.qkv_net.weight", "layers.{l}.attn.qkv.weight"),
    ("transformer.layers.{l}.dec_attn.r_net.weight", "layers.{l}.attn.r_proj.weight"),
    ("transformer.layers.{l}.dec_attn.o_net.weight", "layers.{l}.attn.out.weight"),
    ("transformer.layers.{l}.dec_attn.layer_norm.{p}", "layers.{l}.attn.norm.{p}"),
    ("transformer.layers.{l}.dec_attn.r_w_bias", "layers.{l}.attn.u"),
    ("transformer.layers.{l}.dec_attn.r_r_bias", "layers.{l}.attn.v"),
    ("transformer.layers.{l}.pos_ff.CoreNet.0.{p}", "layers.{l}.ff.fc1.{p}"),
    ("transformer.layers.{l}.pos_ff.CoreNet.3.{p}", "layers.{l}.ff.fc2.{p}"),
    ("transformer.layers.{l}.pos_ff.layer_norm.{p}", "layers.{l}.ff.norm.{p}"),
    ("crit.cluster_weight", "softmax.cluster_weight"),
    ("crit.cluster_bias", "softmax.cluster_bias"),
    ("crit.out_layers.{i}.{p}", "softmax.layers.{i}.{p}"),
    ("crit.out_projs.{i}", "softmax.projs.{i}"),
]
_FIELDS = {"l": r"\d+", "i": r"\d+", "p": "weight|bias"}
# Buffers Hugging Face saves that we recompute (the sinusoid's frequencies have no parameters).
_RECOMPUTED = {"transformer.pos_emb.inv_freq"}


def _compile(template: str) -> re.Pattern[str]:
    pattern = re.escape(template)
    for name, rx in _FIELDS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{rx})")
    return re.compile(pattern)


_FROM_HF = [(_compile(hf), ours) for hf, ours in _KEY_MAP]
_TO_HF = [(_compile(ours), hf) for hf, ours in _KEY_MAP]


def _rename(key: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        m = pattern.fullmatch(key)
        if m:
            return template.format(**m.groupdict())
    return None


def is_hf_config(data: dict[str, Any]) -> bool:
    return data.get("model_type") in ("transfo-xl", "transfo_xl") or "TransfoXLLMHeadModel" in data.get(
        "architectures", [])


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from a Hugging Face TransfoXLConfig dict (its config.json)."""
    if hf.get("attn_type", 0) != 0:
        raise ValueError(f"Hugging Face attn_type={hf['attn_type']} is not supported: only 0 (relative) "
                         "exists in transformers; convert from the original code instead")
    if hf.get("sample_softmax", -1) > 0:
        raise ValueError("sample_softmax > 0 (sampled softmax training) is not supported; set it to -1")
    vocab = hf.get("vocab_size", hf.get("n_token"))
    if vocab is None:
        raise ValueError("Hugging Face config has neither vocab_size nor n_token")
    return ModelConfig(
        vocab_size=vocab, n_layer=hf["n_layer"], d_model=hf["d_model"], n_head=hf["n_head"],
        d_head=hf["d_head"], d_inner=hf["d_inner"], d_embed=hf.get("d_embed", hf["d_model"]),
        cutoffs=list(hf.get("cutoffs", [])), div_val=hf.get("div_val", 1),
        tie_weight=hf.get("tie_word_embeddings", hf.get("tie_weight", True)),
        tie_projs=list(hf["tie_projs"]) if hf.get("tie_projs") is not None else None,
        dropout=hf.get("dropout", 0.1), dropatt=hf.get("dropatt", 0.0), mem_len=hf.get("mem_len", 0) or 0,
        clamp_len=hf.get("clamp_len", -1), same_length=hf.get("same_length", False),
        same_length_style="pytorch", untie_r=hf.get("untie_r", True), pre_ln=hf.get("pre_lnorm", False),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5), init_std=hf.get("init_std", 0.02),
        proj_init_std=hf.get("proj_init_std", 0.01),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face TransfoXLConfig dict; raises for what that layout cannot express."""
    if config.attn_type != "relative":
        raise ValueError(f"attn_type={config.attn_type!r} cannot be exported: the Hugging Face layout has "
                         "only the relative attention")
    if config.same_length and config.same_length_style != "pytorch":
        raise ValueError("same_length_style='tensorflow' cannot be exported: Hugging Face uses 'pytorch'")
    if config.ext_len:
        raise ValueError("ext_len > 0 cannot be exported: Hugging Face has no extended context")
    return {
        "architectures": ["TransfoXLLMHeadModel"], "model_type": "transfo-xl",
        "vocab_size": config.vocab_size, "cutoffs": list(config.cutoffs), "d_model": config.d_model,
        "d_embed": config.d_embed, "n_head": config.n_head, "d_head": config.d_head,
        "d_inner": config.d_inner, "div_val": config.div_val, "pre_lnorm": config.pre_ln,
        "n_layer": config.n_layer, "mem_len": config.mem_len, "clamp_len": config.clamp_len,
        "same_length": config.same_length, "proj_share_all_but_first": config.tie_projs[1:] == [True] * (
            len(config.tie_projs) - 1), "tie_projs": list(config.tie_projs), "attn_type": 0,
        "sample_softmax": -1, "adaptive": True, "dropout": config.dropout, "dropatt": config.dropatt,
        "untie_r": config.untie_r, "init": "normal", "init_range": 0.01, "proj_init_std": config.proj_init_std,
        "init_std": config.init_std, "layer_norm_epsilon": config.layer_norm_eps,
        "tie_word_embeddings": config.tie_weight, "eos_token_id": 0,
    }


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], *,
                       cluster_order: ClusterOrder = "hf") -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict to ours. Every key must be consumed."""
    ours, unknown = {}, []
    for key, tensor in hf_state.items():
        if key in _RECOMPUTED:
            continue
        mapped = _rename(key, _FROM_HF)
        if mapped is None:
            unknown.append(key)
        else:
            ours[mapped] = tensor
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} key(s) that are not part of a Transformer-XL LM "
                         f"head model: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    # With untie_r false, Hugging Face registers the shared u, v under every layer as well.
    for shared in ("u", "v"):
        if shared in ours:
            for key in [k for k in ours if re.fullmatch(rf"layers\.\d+\.attn\.{shared}", k)]:
                if not torch.equal(ours.pop(key), ours[shared]):
                    raise ValueError(f"checkpoint has a per-layer {key} that differs from the shared one: "
                                     "set untie_r=true in its config")
    if cluster_order == "original_pytorch":  # column -i scored cluster i: reverse to column C - i
        for name in ("softmax.cluster_weight", "softmax.cluster_bias"):
            if name in ours:
                ours[name] = ours[name].flip(0)
    return ours


def state_dict_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our state dict (all keys, tied ones included) to the Hugging Face layout."""
    out = {}
    for key, tensor in state.items():
        hf_key = _rename(key, _TO_HF)
        if hf_key is None:
            raise ValueError(f"parameter {key!r} has no Hugging Face equivalent")
        out[hf_key] = tensor
    return out
