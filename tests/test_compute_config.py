"""ComputeConfig: how the model is computed, apart from what it is (issue 45). A run carries it as its [compute]
section (``--compute.FIELD``); the model resolves it into its plan; a checkpoint stores only the ModelConfig and
loads under any compute config. Configs and checkpoints of before, whose model section held the six how-fields,
still load: a run's move to [compute], a model read alone drops them."""

import dataclasses
import json

import pytest
import torch
from conftest import tiny_config

import txl
from txl import checkpoint
from txl.config import MOVED_FIELDS, ComputeConfig, ModelConfig, RunConfig
from txl.model import plan
from txl.presets import apply_overrides, run_config, typed
from txl.pretrained import from_pretrained, save_pretrained

OLD_HOW = dict(attn_impl="reference", recompute_attention=True, dropout_impl="fast16", cluster_rows="all",
               softmax_pad=64, cast_weights="per_use")
"""A model section of before issue 45 held these (and 'fast16', a value retired since, reads as 'fast')."""
TOL = dict(atol=1e-5, rtol=1e-5)


def test_the_how_fields_are_the_compute_configs_not_the_models():
    how = {f.name for f in dataclasses.fields(ComputeConfig)}
    assert how == set(MOVED_FIELDS) == set(OLD_HOW)
    assert not how & {f.name for f in dataclasses.fields(ModelConfig)}
    assert RunConfig(model=tiny_config()).compute == ComputeConfig()
    with pytest.raises(ValueError, match=r"ComputeConfig.cluster_rows='some' is unknown; choose one of 'auto', "):
        ComputeConfig(cluster_rows="some")
    with pytest.raises(ValueError, match=r"ComputeConfig.softmax_pad=-1 must be an integer >= 0"):
        ComputeConfig(softmax_pad=-1)
    with pytest.raises(TypeError, match="attn_impl"):  # not a ModelConfig field any more
        ModelConfig(vocab_size=10, attn_impl="reference")


def test_an_old_model_section_moves_to_compute_in_a_run_and_is_dropped_from_a_model():
    saved = {**tiny_config().to_dict(), **OLD_HOW, "state_dtype": "compute"}
    run = RunConfig.from_dict({"model": saved})
    assert run.model == tiny_config()
    assert run.compute == ComputeConfig(**{**OLD_HOW, "dropout_impl": "fast"})
    assert ModelConfig.from_dict(saved) == tiny_config()  # a model read alone: its weights load under any plan
    # A run that has a [compute] section too: the section's own values win over the moved ones.
    both = RunConfig.from_dict({"model": saved, "compute": {"attn_impl": "fused"}})
    assert (both.compute.attn_impl, both.compute.softmax_pad) == ("fused", 64)
    # Round trip: what a run writes now holds the how in [compute], none of it in [model].
    again = RunConfig.from_dict(json.loads(json.dumps(run.to_dict())))
    assert again == run and not set(MOVED_FIELDS) & set(run.to_dict()["model"])


def test_an_old_toml_model_section_types_its_moved_fields_as_compute_does():
    # Text values (a TOML written as strings, a run.json edited by hand) of the moved fields are typed with
    # ComputeConfig's hints, then moved: not handed on as strings ('false' would read as true).
    data = typed({"model": {"recompute_attention": "false", "softmax_pad": "64", "mem_len": "10"}})
    assert data["model"] == {"recompute_attention": False, "softmax_pad": 64, "mem_len": 10}
    run = RunConfig.from_dict({"model": {**tiny_config().to_dict(), **data["model"]}})
    assert (run.compute.recompute_attention, run.compute.softmax_pad, run.model.mem_len) == (False, 64, 10)
    with pytest.raises(ValueError, match="softmax_pad"):
        typed({"model": {"softmax_pad": "wide"}})


def test_the_command_line_sets_compute_and_names_the_moved_flag():
    cfg = run_config("tiny", {"compute.attn_impl": "reference", "compute.softmax_pad": "8"})
    assert (cfg.compute.attn_impl, cfg.compute.softmax_pad) == ("reference", 8)
    with pytest.raises(ValueError, match=r"unknown field model.attn_impl: it is compute.attn_impl now "
                                         r"\(--compute.attn_impl;"):
        apply_overrides({}, {"model.attn_impl": "reference"})
    with pytest.raises(ValueError, match="compute.attn_impl='flash' is not allowed"):
        apply_overrides({}, {"compute.attn_impl": "flash"})


def test_a_model_is_built_with_its_compute_config_and_plans_from_it():
    compute = ComputeConfig(attn_impl="reference", cluster_rows="all", softmax_pad=8)
    model = txl.TransformerXL(tiny_config(cutoffs=[20, 40]), compute)
    assert model.compute is compute and model.plan == plan.compute_plan(compute, "cpu")
    assert (model.softmax.rows, model.softmax.pad) == ("all", 8)
    assert txl.TransformerXL(tiny_config()).compute == ComputeConfig()


def _old_checkpoint(directory, model, run: RunConfig):
    """A checkpoint as txl wrote it before issue 45: the how-fields in the model section of its config.json and of
    its run.json, no [compute] section."""
    save_pretrained(model, directory)
    config = json.loads((directory / "config.json").read_text())
    config["model"].update(OLD_HOW)
    (directory / "config.json").write_text(json.dumps(config))
    old = run.to_dict()
    old.pop("compute")
    old["model"].update(OLD_HOW)
    (directory / "run.json").write_text(json.dumps(old))


def test_an_old_checkpoint_loads_with_its_how_in_compute_and_under_any_other(tmp_path):
    """The old checkpoint loads without an error: the run's how (here the plain path, every cluster row, widths
    padded to 64) is its [compute] section and what the model computes with, unless the caller gives another; both
    compute the same log-probabilities and memory as the model that was saved."""
    torch.manual_seed(0)
    config = tiny_config(cutoffs=[20, 40])
    saved = txl.TransformerXL(config).eval()
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    _old_checkpoint(tmp_path, saved, RunConfig(model=config))
    loaded = checkpoint.load(tmp_path, with_state=False)
    assert loaded.model.config == config and loaded.run.model == config
    assert loaded.run.compute == ComputeConfig(**{**OLD_HOW, "dropout_impl": "fast"})
    assert loaded.model.compute == loaded.run.compute and loaded.model.plan.attn_impl == "reference"
    fused = checkpoint.load(tmp_path, with_state=False, compute=ComputeConfig()).model
    alone = from_pretrained(tmp_path)  # a model directory read alone: the default compute config
    assert fused.plan.attn_impl == alone.plan.attn_impl == "fused" and alone.config == config
    tokens = torch.randint(0, config.vocab_size, (2, 13))
    with torch.no_grad():
        want = saved(tokens[:, :6])
        want = (want, saved(tokens[:, 6:12], memory=want.memory))
        for model in (loaded.model, fused, alone):
            first = model(tokens[:, :6])
            second = model(tokens[:, 6:12], memory=first.memory)
            for got, expected in zip((first, second), want, strict=True):
                torch.testing.assert_close(got.log_probs, expected.log_probs, **TOL)
                for a, b in zip(got.memory, expected.memory, strict=True):
                    torch.testing.assert_close(a, b, **TOL)


def test_a_checkpoint_trained_under_one_plan_trains_on_under_another(tmp_path):
    """Weights saved by a model computed one way (the fused path, CUDA's resolution: every cluster row, padded
    widths, torch's dropout) load into one computed another way (the plain path): the same loss and gradients."""
    torch.manual_seed(0)
    config = tiny_config(cutoffs=[20, 40])
    one = txl.TransformerXL(config, plan.resolve(ComputeConfig(), "cuda"))
    save_pretrained(one, tmp_path)
    other = from_pretrained(tmp_path, compute=ComputeConfig(attn_impl="reference")).train()
    assert (one.plan.attn_impl, other.plan.attn_impl, one.softmax.pad) == ("fused", "reference", 64)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    grads = []
    for model in (one.train(), other):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], **TOL)
    assert grads[0][1].keys() == grads[1][1].keys()
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grad, grads[1][1][name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.slow  # a two-step training run, then three evaluations
def test_txl_eval_computes_a_run_as_it_ran_or_as_asked(corpus, tmp_path, monkeypatch):
    """``txl eval RUN`` computes the model as the run did (its [compute]); ``--compute.FIELD`` changes how, not the
    figure (the plain path's loss equals the fused one's)."""
    import txl.evaluate
    from txl.cli import main
    from txl.config import DataConfig, TrainConfig
    from txl.data.corpora import load_run_corpus

    cfg = RunConfig(data=DataConfig(corpus=corpus, level="byte"), model=tiny_config(vocab_size=256),
                    compute=ComputeConfig(softmax_pad=8),
                    train=TrainConfig(out_dir=str(tmp_path / "run"), max_steps=2, batch_size=2, tgt_len=4,
                                      progress=False, tensorboard=False, plot=False, eval_batches=1, eval_interval=0,
                                      device="cpu", precision="fp32", sample_tokens=0))
    txl.train.train(cfg, corpus=load_run_corpus(cfg.data))
    seen, real = [], txl.evaluate.evaluate

    def spy(model, *args, **kwargs):
        result = real(model, *args, **kwargs)
        seen.append((model.compute, result.loss))
        return result

    monkeypatch.setattr(txl.evaluate, "evaluate", spy)
    for flags in ([], ["--compute.attn_impl", "reference"]):
        assert main(["eval", str(tmp_path / "run"), "--max-batches", "3", "--no-progress", *flags]) == 0
    assert [compute for compute, _ in seen] == [cfg.compute, cfg.compute.replace(attn_impl="reference")]
    assert seen[0][1] == pytest.approx(seen[1][1], rel=1e-5)
