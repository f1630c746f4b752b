"""Per-token NLL, log-probabilities and memories equal the Hugging Face reference over 3 segments."""

import pytest
import torch
from hf_oracle import hf_model, ours_from_hf

import txl

pytestmark = pytest.mark.oracle  # against transformers==4.37.2 (see hf_oracle.py)

CONFIGS = {
    "div1_cutoffs": dict(),
    "div4_cutoffs": dict(div_val=4, d_embed=64, cutoffs=[20, 50, 80], tie_projs=[False, True, False, True]),
    "div2_proj_d_embed": dict(div_val=2, d_embed=48, cutoffs=[30], tie_projs=[True, True]),
    "no_cutoffs": dict(cutoffs=[], tie_projs=[False]),
    "no_cutoffs_projected": dict(cutoffs=[], d_embed=24, tie_projs=[True]),
    "div1_projected_tied": dict(d_embed=16, tie_projs=[True, True, False]),
    "shared_r_bias": dict(untie_r=False),
    "same_length": dict(same_length=True),
    "same_length_short_mem": dict(same_length=True, mem_len=5),
    "clamp_len": dict(clamp_len=4),
    "mem_len_0": dict(mem_len=0),
    "pre_ln": dict(pre_lnorm=True),
    "untied_weights": dict(tie_word_embeddings=False),
}

SEGMENT, BATCH, N_SEGMENTS = 7, 3, 3
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_over_segments(name, impl):
    """Both paths: the default and the plain one (txl.model.plain, the oracle of the others)."""
    hf = hf_model(**CONFIGS[name])
    ours = ours_from_hf(hf)
    if impl != ours.plan.attn_impl:
        plain = txl.TransformerXL(ours.config, txl.ComputeConfig(attn_impl=impl)).eval()
        plain.load_state_dict(ours.state_dict())
        ours = plain
    cfg = ours.config
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEGMENT * N_SEGMENTS + 1))
    # Hugging Face starts from zeros that are attended to: ours takes the same with init_memory.
    memory = ours.init_memory(BATCH, cfg.mem_len)
    hf_mems = None
    diff = {"log_probs": 0.0, "nll": 0.0, "memory": 0.0}
    with torch.no_grad():
        for s in range(N_SEGMENTS):
            x = tokens[:, s * SEGMENT:(s + 1) * SEGMENT]
            y = tokens[:, s * SEGMENT + 1:(s + 1) * SEGMENT + 1]
            ref = hf(input_ids=x, mems=hf_mems)
            ref_nll = hf(input_ids=x, mems=hf_mems, labels=x).losses  # (B, T-1): shifted inside
            out = ours(x, labels=y, memory=memory, return_log_probs=True)
            torch.testing.assert_close(out.log_probs, ref.prediction_scores, **TOL)
            torch.testing.assert_close(out.nll[:, :-1], ref_nll, **TOL)
            if cfg.mem_len:
                for ours_m, hf_m in zip(out.memory, ref.mems, strict=True):
                    torch.testing.assert_close(ours_m, hf_m.transpose(0, 1), **TOL)
            else:
                assert ref.mems is None and all(m.size(1) == 0 for m in out.memory)
            diff["log_probs"] = max(diff["log_probs"], (out.log_probs - ref.prediction_scores).abs().max().item())
            diff["nll"] = max(diff["nll"], (out.nll[:, :-1] - ref_nll).abs().max().item())
            if cfg.mem_len:
                diff["memory"] = max(diff["memory"], max((a - b.transpose(0, 1)).abs().max().item()
                                                         for a, b in zip(out.memory, ref.mems, strict=True)))
            memory, hf_mems = out.memory, ref.mems
    print(f"{name}: max abs diff " + ", ".join(f"{k} {v:.1e}" for k, v in diff.items()))
