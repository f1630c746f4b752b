"""txl.rl.core: the agent's Transformer-XL memory (torch only: runs in CI with .[dev])."""

import pytest
import torch

from txl.config import ModelConfig
from txl.model.attention import build_attention
from txl.model.positions import Positions, relative_distances, sinusoid
from txl.rl.core import AgentConfig, AgentMemory, GRUGate, TransformerXLCore, episode_masks, episode_steps

ATTN_TYPES = ("relative", "shaw", "absolute", "al_rfou", "rotary")
KINDS = ("plain", "pre_ln", "gated")


def make_core(attn_type="relative", layer="plain", mem_len=4, seed=0, **kw):
    torch.manual_seed(seed)
    config = AgentConfig(d_input=5, d_model=16, n_layer=2, n_head=2, d_inner=32, mem_len=mem_len,
                         attn_type=attn_type, layer=layer, learned_positions=6, **kw)
    core = TransformerXLCore(config).double()
    # Learned positional tables away from their small start, so a wrong index shows.
    with torch.no_grad():
        for name, p in core.named_parameters():
            if name.split(".")[-1] in ("r_emb", "r_bias", "u", "v", "pos_embed"):
                p.normal_(0, 1.0)
    return core


def act(core, obs, starts, memory):
    """Step through obs (N, T, d_input) one step at a time: (N, T, d)."""
    return torch.stack([core.step(obs[:, t], memory, starts[:, t]) for t in range(obs.size(1))], 1)


@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_step_path_equals_sequence_path(attn_type, layer):
    """Acting step by step through episodes (starts mid-sequence, a memory already holding steps) gives the sequence
    path's outputs over the same steps from the same memory."""
    core = make_core(attn_type, layer)
    g = torch.Generator().manual_seed(1)
    N, T = 3, 13  # T > 2 M: the window slides, and episode indices pass learned_positions
    memory = core.initial_memory(N, dtype=torch.float64)
    with torch.no_grad():
        act(core, torch.randn(N, 3, 5, generator=g, dtype=torch.float64), torch.zeros(N, 3, dtype=torch.bool), memory)
    snapshot = memory.clone()
    obs = torch.randn(N, T, 5, generator=g, dtype=torch.float64)
    starts = torch.zeros(N, T, dtype=torch.bool)
    starts[0, 0] = True  # row 0: a new episode at the first step (its memory is not read)
    starts[1, 5] = starts[1, 6] = True  # row 1: a one-step episode, then another
    with torch.no_grad():
        stepped = act(core, obs, starts, memory)
        sequence = core(obs, snapshot, starts).hidden
    torch.testing.assert_close(sequence, stepped, rtol=0, atol=1e-5)
    assert not torch.equal(stepped[0, 1], stepped[2, 1])  # rows differ: the check is not vacuous


def test_reset_row_equals_fresh_row_and_leaves_others_bit_identical():
    core = make_core("relative", "gated")
    g = torch.Generator().manual_seed(2)
    N = 3
    memory = core.initial_memory(N, dtype=torch.float64)
    history = torch.randn(N, 6, 5, generator=g, dtype=torch.float64)
    with torch.no_grad():
        act(core, history, torch.zeros(N, 6, dtype=torch.bool), memory)
    untouched = memory.clone()
    nxt = torch.randn(N, 5, generator=g, dtype=torch.float64)
    with torch.no_grad():
        out = core.step(nxt, memory, torch.tensor([False, True, False]))
        plain = core.step(nxt, untouched, torch.zeros(N, dtype=torch.bool))
        fresh_memory = core.initial_memory(1, dtype=torch.float64)
        fresh = core.step(nxt[1:2], fresh_memory, torch.ones(1, dtype=torch.bool))
    torch.testing.assert_close(out[1], fresh[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(memory.states[:, 1:2], fresh_memory.states, rtol=0, atol=1e-12)
    assert torch.equal(memory.valid[1:2], fresh_memory.valid) and torch.equal(memory.t[1:2], fresh_memory.t)
    others = torch.tensor([0, 2])
    assert torch.equal(out[others], plain[others])
    assert torch.equal(memory.states[:, others], untouched.states[:, others])
    assert torch.equal(memory.valid[others], untouched.valid[others])
    assert not torch.allclose(out[1], plain[1])  # the reset did something


def test_memory_reset_empties_only_its_rows():
    core = make_core()
    memory = core.initial_memory(2, dtype=torch.float64)
    with torch.no_grad():
        act(core, torch.randn(2, 3, 5, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.bool), memory)
    before = memory.clone()
    memory.reset(torch.tensor([True, False]))
    assert memory.states[:, 0].abs().sum() == 0 and not memory.valid[0].any() and memory.t[0] == 0
    assert torch.equal(memory.states[:, 1], before.states[:, 1]) and memory.t[1] == 3


def test_attention_never_crosses_an_episode_start():
    """After a start, outputs do not depend on anything before it: not the steps of the earlier episode in the same
    sequence, nor the memory; and they equal a run of that episode alone from empty memory."""
    core = make_core("relative", "plain")
    g = torch.Generator().manual_seed(3)
    B, T, s = 2, 9, 4
    memory = AgentMemory(torch.randn(2, B, 4, 16, generator=g, dtype=torch.float64),
                         torch.ones(B, 4, dtype=torch.bool), torch.full((B,), 7))
    obs = torch.randn(B, T, 5, generator=g, dtype=torch.float64)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[:, s] = True
    other_obs = obs.clone()
    other_obs[:, :s] = torch.randn(B, s, 5, generator=g, dtype=torch.float64)
    other_memory = AgentMemory(torch.randn_like(memory.states), memory.valid.clone(), memory.t.clone())
    with torch.no_grad():
        out = core(obs, memory, starts).hidden
        changed = core(other_obs, other_memory, starts).hidden
        alone = core(obs[:, s:], core.initial_memory(B, dtype=torch.float64), starts[:, s:]).hidden
    assert torch.equal(out[:, s:], changed[:, s:])
    torch.testing.assert_close(out[:, s:], alone, rtol=0, atol=1e-12)
    assert not torch.allclose(out[:, :s], changed[:, :s])


def test_episode_masks_by_hand():
    # M = 2, one row: memory slot 0 empty, slot 1 valid; a start at step 2 of T = 3.
    hide = episode_masks(torch.tensor([[False, True]]), torch.tensor([[False, False, True]]), 2)
    visible = (~hide[0, 0]).int().tolist()
    #            m0 m1 s0 s1 s2
    assert visible == [[0, 1, 1, 0, 0],   # step 0: valid memory and itself
                       [0, 1, 1, 1, 0],   # step 1: M = 2 back reaches m1
                       [0, 0, 0, 0, 1]]   # step 2: a new episode sees itself alone
    steps = episode_steps(torch.tensor([5]), torch.tensor([[False, False, True, False]]))
    assert steps.tolist() == [[5, 6, 0, 1]]


def test_horizon_is_layers_times_memory():
    """The output at step t depends on the input at step t - L*M and not on t - L*M - 1."""
    core = make_core("relative", "pre_ln", mem_len=3)
    L, M = 2, 3
    T = L * M + 2
    obs = torch.randn(1, T, 5, dtype=torch.float64, requires_grad=True)
    out = core(obs, core.initial_memory(1, dtype=torch.float64), torch.zeros(1, T, dtype=torch.bool)).hidden
    (out[0, -1] * torch.randn(16, dtype=torch.float64)).sum().backward()  # not .sum(): a layer norm's is constant
    reached = obs.grad[0].abs().sum(-1) > 0  # (T,)
    assert reached.tolist() == [False] + [True] * (T - 1)
    assert core.config.horizon == L * M


def test_gate_starts_near_identity():
    torch.manual_seed(0)
    d = 64
    x, y = torch.randn(4096, d), torch.randn(4096, d)
    gate = GRUGate(d, gate_bias=2.0)
    z = gate.update_gate(x, y)
    assert abs(z.mean().item() - torch.sigmoid(torch.tensor(-2.0)).item()) < 0.05
    assert abs(GRUGate(d, gate_bias=0.0).update_gate(x, y).mean().item() - 0.5) < 0.02
    # Whole layers at initialisation: the gated one moves its input far less than the ungated pre-LN one.
    moved = {}
    for kind in ("gated", "pre_ln"):
        core = make_core("relative", kind, seed=1)
        gated_z = [g.update_gate(x[:, :16].double(), y[:, :16].double()).mean().item()
                   for g in core.modules() if isinstance(g, GRUGate)]
        assert all(abs(v - 0.12) < 0.06 for v in gated_z)
        h = torch.randn(8, 5, 16, dtype=torch.float64)
        layer = core.layers[0]
        with torch.no_grad():
            out = layer(h, torch.zeros(8, 4, 16, dtype=torch.float64),
                        episode_masks(torch.zeros(8, 4, dtype=torch.bool), torch.zeros(8, 5, dtype=torch.bool), 4))
        moved[kind] = ((out - h).norm() / h.norm()).item()
    assert moved["gated"] < 0.5 * moved["pre_ln"], moved


@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_attention_equals_the_packages_reference(attn_type):
    """The plain layer's attention + residual + LN equals txl.model's Attention layer."""
    core = make_core(attn_type, "plain")
    layer = core.layers[0]
    cfg = ModelConfig(vocab_size=10, n_layer=2, d_model=16, n_head=2, d_inner=32, attn_type=attn_type,
                      dropout=0.0, learned_positions=6, mem_len=4)
    ref = build_attention(cfg).double()
    own = {"qkv.weight": layer.attn.qkv.weight, "out.weight": layer.attn.out.weight,
           "norm.weight": layer.norm1.weight, "norm.bias": layer.norm1.bias}
    for name in ("r_proj.weight", "r_emb", "r_bias"):
        if name in ref.state_dict():
            own[name] = layer.attn.get_parameter(name)
    if attn_type == "shaw":
        own["u"] = layer.attn.u
    ref.load_state_dict(own)
    g = torch.Generator().manual_seed(4)
    B, T, M = 2, 5, 4
    x = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
    mem = torch.randn(B, M, 16, generator=g, dtype=torch.float64)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[1, 2] = True
    hide = episode_masks(torch.ones(B, M, dtype=torch.bool), starts, M)
    positions = None
    if attn_type == "relative":
        positions = Positions(encodings=sinusoid(relative_distances(M + T, -1), 16).double())
    u = layer.attn.u if attn_type == "relative" else None
    v = layer.attn.v if attn_type == "relative" else None
    with torch.no_grad():
        expected = ref(x, mem, hide, positions, u, v)
        window = torch.cat([mem, x], 1)
        got = layer.norm1(x + layer.attn(x, window, hide))
    # The reference takes its softmax in float32 (its probabilities are cast to the values' dtype): 1e-6 in float64.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_bad_config_and_shapes_are_refused():
    with pytest.raises(ValueError, match="n_head=3 must divide d_model=16"):
        AgentConfig(d_input=2, d_model=16, n_head=3)
    with pytest.raises(ValueError, match="attn_type='learned'"):
        AgentConfig(d_input=2, attn_type="learned")
    with pytest.raises(ValueError, match="layer='gtrxl'"):
        AgentConfig(d_input=2, layer="gtrxl")
    core = make_core()
    with pytest.raises(ValueError, match="must agree on B rows"):
        core(torch.zeros(2, 3, 5, dtype=torch.float64), core.initial_memory(3, dtype=torch.float64),
             torch.zeros(2, 3, dtype=torch.bool))


@pytest.mark.slow
def test_the_docs_example_runs_and_its_two_paths_agree():
    """docs/rl.md's API example, run as written (a subprocess), with a check of its claim appended."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = re.search(r"```python\n(.*?)```", (root / "docs" / "rl.md").read_text(), re.S).group(1)
    code += "\nassert (out - torch.stack(hs, 1)).abs().max() < 1e-5\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
