import pytest
import torch

from txl.config import ModelConfig, OptimConfig, RunConfig, TrainConfig
from txl.model import TransformerXL
from txl.presets import apply_overrides, load_preset, parameter_count, preset_names, run_config

# Parameter counts: Dai et al. 2019 Tables 1-3 where the paper's count matches its own hyper-parameters.
# wt103_large: the paper reports 257M, but its hyper-parameters (and the released checkpoint that Hugging
# Face distributes) give 285M; lm1b_base: the paper reports 0.46B with untied output embeddings, we tie.
PAPER_PARAMS = {"enwik8_base": 41e6, "enwik8_large": 277e6, "text8_large": 277e6, "wt103_base": 151e6,
                "wt103_large": 285e6, "lm1b_base": 357e6}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters counted once


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_builds_on_meta(name):
    cfg = run_config(name)
    with torch.device("meta"):
        model = TransformerXL(cfg.model)
    n = n_params(model)
    assert parameter_count(cfg.model) == n  # what `txl train --list-presets` prints, counted without torch
    if name in PAPER_PARAMS:
        assert abs(n - PAPER_PARAMS[name]) / PAPER_PARAMS[name] < 0.03, (name, n)


@pytest.mark.parametrize("change", [dict(cutoffs=[50, 100]), dict(cutoffs=[50, 100], div_val=2),
                                    dict(cutoffs=[50, 100], div_val=2, tie_weight=False,
                                         tie_projs=[False, True, False]),
                                    dict(cutoffs=[50, 100], d_embed=48, tie_projs=[False, True, True]),
                                    dict(cutoffs=[50, 100], d_embed=48, tie_projs=[False, False, False]),
                                    dict(d_embed=48), dict(tie_weight=False), dict(untie_r=True, pre_ln=True),
                                    dict(cmem_len=8, cmem_rate=2, cmem_fn="conv"),
                                    dict(cmem_len=8, cmem_rate=2, cmem_fn="max")])
def test_parameter_count_from_the_config_is_the_models(change):
    """``parameter_count`` (the listing's count, no torch) against the model's own parameters, tied ones once."""
    config = ModelConfig(vocab_size=200, d_model=32, n_head=2, d_head=16, d_inner=64, n_layer=2, mem_len=8,
                         **change)
    with torch.device("meta"):
        assert parameter_count(config) == n_params(TransformerXL(config))
    with pytest.raises(ValueError, match="relative attention only"):
        parameter_count(config.replace(attn_type="shaw", cmem_len=0))


def test_presets_listed():
    assert {"default", "tiny", "enwik8_base", "enwik8_large", "text8_large", "wt103_base", "wt103_large",
            "lm1b_base", "ptb", "pennchar"} <= set(preset_names())


def test_overrides_are_typed():
    data = apply_overrides(load_preset("tiny"), {"model.mem_len": "300", "optim.lr": "1e-3",
                                                 "model.cutoffs": "20,40", "train.var_len": "true",
                                                 "eval.mem_len": "none"})
    cfg = RunConfig.from_dict(data)
    assert cfg.model.mem_len == 300 and cfg.optim.lr == 1e-3 and cfg.model.cutoffs == [20, 40]
    assert cfg.train.var_len is True and cfg.eval.mem_len is None


@pytest.mark.parametrize("key, value, message", [
    ("model.mem_lenn", "3", "unknown field model.mem_lenn (did you mean mem_len?); valid model fields are: "),
    ("modle.mem_len", "3", "unknown option --modle.mem_len"),
    ("model.mem_len", "abc", "model.mem_len='abc' must be an integer"),
    ("optim.lr", "fast", "optim.lr='fast' must be a number"),
    ("train.precision", "fp8", "train.precision='fp8' is not allowed; choose one of"),
    ("train.var_len", "maybe", "must be a boolean"),
])
def test_bad_overrides_name_the_field(key, value, message):
    with pytest.raises(ValueError) as err:
        run_config("tiny", {key: value})
    assert message in str(err.value)
    if "unknown field" in message:
        assert "mem_len" in str(err.value) and "d_model" in str(err.value)


def test_unknown_field_in_preset_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nvocab_size = 10\nlayers = 3\n")
    with pytest.raises(ValueError, match=r"unknown field\(s\) model.layers \(did you mean n_layer\?\); "
                       r"valid model fields are: .*n_layer"):
        run_config(path)
    path.write_text("[model]\nvocab_size = 'ten'\n")
    with pytest.raises(ValueError, match="model.vocab_size='ten' must be an integer"):
        run_config(path)
    path.write_text("[modle]\n")
    with pytest.raises(ValueError, match="unknown config section"):
        run_config(path)
    with pytest.raises(ValueError, match="unknown preset 'nope'; presets are: default"):
        run_config("nope")


def test_configs_that_cannot_work():
    with pytest.raises(ValueError, match="inv_sqrt.*warmup_steps"):
        OptimConfig(schedule="inv_sqrt")
    with pytest.raises(ValueError, match="ext_len"):
        RunConfig(model=ModelConfig(vocab_size=10, ext_len=64), train=TrainConfig(tgt_len=32))


def test_round_trip():
    cfg = run_config("wt103_base")
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def _help(argv):
    import contextlib
    import io

    from txl.cli import build_parser

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    return " ".join(buf.getvalue().split())


def test_train_help_lists_every_field_with_its_docstring_and_default():
    import dataclasses

    from txl.cli.options import field_docs
    from txl.config import SECTIONS

    text = _help(["train", "--help"])
    for section, kind in SECTIONS.items():
        docs = field_docs(kind)
        for f in dataclasses.fields(kind):
            assert f"--{section}.{f.name}" in text, f.name
            if f.name in docs:
                assert docs[f.name][:40] in text, f.name
    assert "--model.mem_len INT Hidden states kept per layer from earlier segments (0 turns recurrence off). " \
           "(default: 128; preset 'default': 64)" in text
    assert "evaluates the TEST split by default" not in text  # that is eval's help
    assert "on the TEST split by default" in _help(["eval", "--help"])


def test_every_option_of_every_command_has_help():
    """`txl COMMAND --help` explains every option (`txl export --format` and `txl eval --device` had none, issue 44)."""
    import argparse

    from txl.cli import build_parser

    def silent(parser: argparse.ArgumentParser, command: str) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += silent(sub, f"{command} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                found.append(f"{command} {'/'.join(action.option_strings) or action.dest}")
        return found

    assert silent(build_parser(), "txl") == []
    assert "onnx: an ONNX graph for onnxruntime" in " ".join(_help(["export", "--help"]).split())


@pytest.mark.slow  # a real subprocess
def test_help_and_the_preset_listing_do_not_import_torch():
    """`txl --help`, `txl train --help` and `txl train --list-presets` answer without importing torch (it costs
    seconds and 200 MB: the listing took 5-18 s and 309 MB where it now takes 0.2 s and 19 MB, issue 44)."""
    import subprocess
    import sys

    code = ("import sys\nfrom txl.cli import main\nfor argv in (['--help'], ['train', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert main(['train', '--list-presets']) == 0\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "torch not imported", proc.stderr[-2000:]


def test_list_presets_one_line_each(capsys):
    from txl.cli import main

    assert main(["train", "--list-presets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(preset_names())
    by_name = {line.split()[0]: line for line in lines}
    assert "0.9M params" in by_name["default"] and "about 4.5 min on one CPU thread" in by_name["default"]
    assert "41.1M params" in by_name["enwik8_base"] and "Table 2" in by_name["enwik8_base"]


def _train_args(argv):
    from txl.cli import build_parser
    from txl.cli.train import build_config

    return build_config(build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("argv", [["--model.cmem_rate", "4", "--model.cmem_fn", "max"], ["--model.cmem_rate", "4"]])
def test_a_compression_setting_without_cmem_len_is_refused_not_ignored(argv):
    """cmem_rate / cmem_fn on the command line without cmem_len (0 by default) would train the plain model: refused,
    naming the fix (issue 44); with cmem_len they build the compressive model, and an explicit cmem_len 0 is a
    choice (tests/test_compressive.py trains the golden run so)."""
    given = " ".join(argv)
    with pytest.raises(ValueError, match=f"^{given} configures the compressed memory, which model.cmem_len 0 "
                                         rf"switches off .*add --model.cmem_len N.*or drop {given}$"):
        _train_args(argv)
    assert _train_args([*argv, "--model.cmem_len", "16"]).model.cmem_len == 16
    assert _train_args([*argv, "--model.cmem_len", "0"]).model.cmem_len == 0
    assert _train_args(["--config", "tiny"]).model.cmem_len == 0  # the defaults alone are not a request


def test_explicit_max_steps_beats_a_presets_time_budget():
    assert run_config("ptb").train.minutes == 30
    assert _train_args(["--preset", "ptb", "--max-steps", "50"]).train.minutes == 0
    assert _train_args(["--preset", "ptb", "--train.max_steps", "50"]).train.minutes == 0
    assert _train_args(["--preset", "ptb", "--max-steps", "50", "--minutes", "3"]).train.minutes == 3
    assert _train_args(["--preset", "ptb"]).train.minutes == 30
    default = _train_args([]).train
    assert (default.max_steps, default.minutes, default.seed) == (2000, 0, 0)  # fixed, seeded steps


def test_min_lr_follows_an_lr_given_alone():
    """The README's fine-tuning rate, 2.5e-5, lies below the default preset's min_lr 1e-4: min_lr keeps its ratio
    to lr (1e-4 / 2e-3) instead of refusing the run; an explicit min_lr is taken as given and checked."""
    default = _train_args([]).optim
    assert (default.lr, default.min_lr) == (2e-3, 1e-4)
    tuned = _train_args(["--optim.lr", "2.5e-5"]).optim
    assert tuned.lr == 2.5e-5 and tuned.min_lr == pytest.approx(2.5e-5 * 1e-4 / 2e-3, rel=1e-12)
    assert _train_args(["--optim.lr", "2.5e-5", "--optim.min_lr", "0"]).optim.min_lr == 0
    with pytest.raises(ValueError, match=r"OptimConfig.min_lr=0.0001 must lie in \[0, lr\]"):
        _train_args(["--optim.lr", "2.5e-5", "--optim.min_lr", "1e-4"])


@pytest.mark.parametrize("preset", ["default", "tiny"])
def test_corpus_level_follows_the_readme_under_every_cpu_preset(preset, tmp_path):
    """README: a directory is read at word level unless --data.level says otherwise, a single file at character
    level; the presets' own corpus (stdlib) stays byte level."""
    from txl.data.corpora import get_spec

    folder = tmp_path / "mine"
    folder.mkdir()
    for split in ("train", "valid", "test"):
        (folder / f"{split}.txt").write_text("a b c\n")

    def level(*argv):
        data = _train_args(["--preset", preset, *argv]).data
        return get_spec(data.corpus, level=data.level)[0].level

    assert level() == "byte"
    assert level("--data.corpus", str(folder)) == "word"
    assert level("--data.corpus", str(folder / "train.txt")) == "char"
    assert level("--data.corpus", str(folder), "--data.level", "byte") == "byte"


def test_config_accepts_a_saved_run_json(tmp_path):
    cfg = _train_args(["--preset", "tiny", "--model.mem_len", "7", "--optim.lr", "3e-3"])
    saved = tmp_path / "run.json"
    saved.write_text(__import__("json").dumps(cfg.to_dict()))
    again = _train_args(["--config", str(saved)])
    assert again == cfg
    assert _train_args(["--config", str(tmp_path), "--model.mem_len", "9"]).model.mem_len == 9  # a run directory


def test_boolean_fields_take_a_value_or_none():
    assert _train_args(["--train.var_len"]).train.var_len is True
    assert _train_args(["--train.var_len", "false"]).train.var_len is False


@pytest.mark.parametrize("argv, message", [
    (["train", "--model.mem_lenn", "3"],
     "unknown field model.mem_lenn (did you mean mem_len?); valid model fields are: "),
    (["train", "--bogus"], "unrecognised argument '--bogus'; config fields are set as --data.FIELD"),
    (["eval", "run", "--model.mem_len", "3"], "txl eval takes no --model.FIELD options; its config options are "
                                              "--eval.FIELD, --data.FIELD"),
])
def test_unknown_options_are_one_line(capsys, argv, message):
    from txl.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_eval_context_is_the_models_where_unset_and_describes_itself():
    """The one rule every command and the trainer apply: an unset [eval] field is the model's (as in training)."""
    from txl.config import EvalConfig

    model = ModelConfig(vocab_size=50, mem_len=16, clamp_len=40, same_length=False, ext_len=2)
    assert EvalConfig().context(model) == model.context()
    ctx = EvalConfig(mem_len=64, same_length=True, clamp_len=0).context(model)
    assert (ctx.mem_len, ctx.clamp_len, ctx.same_length, ctx.ext_len) == (64, 0, True, 2)
    assert model.mem_len == 16  # the config is never changed
    assert ctx.describe() == "mem_len 64, same_length, ext_len 2"
    assert model.context().describe(mem_len="16,32") == "mem_len 16,32, clamp_len 40, ext_len 2"
    assert EvalConfig().segment_len(32) == 32 and EvalConfig(tgt_len=8).segment_len(32) == 8
