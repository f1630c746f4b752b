"""From text to configs: presets, TOML and JSON files, and ``section.field`` overrides, typed.

``txl.config`` holds the dataclasses (plain, typed data); this layer turns what a person writes (a preset
name, a ``.toml`` file, a ``run.json``, ``--model.mem_len 300`` on a command line) into them, with one
error message per bad value naming the field. The argparse surface is ``txl.cli.options``.
"""

from __future__ import annotations

import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

from txl.config import MOVED_FIELDS, SECTIONS, ModelConfig, RunConfig, did_you_mean

PRESET_DIR = Path(__file__).parent / "configs"
"""Presets ship inside the package (the repository's configs/ links here)."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def preset_summary(name: str) -> str:
    """The first comment line of a preset file: what it is."""
    for line in (PRESET_DIR / f"{name}.toml").read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def preset_expected_time(name: str) -> str:
    """The preset file's ``# expected time:`` comment ('' when it has none)."""
    for line in (PRESET_DIR / f"{name}.toml").read_text(encoding="utf-8").splitlines():
        if line.lower().startswith("# expected time:"):
            return line.split(":", 1)[1].strip()
    return ""


def parameter_count(model: ModelConfig) -> int:
    """The parameters of ``TransformerXL(model)``, from the config alone (no torch: ``txl train --list-presets``
    reads this in a fraction of a second, where building each preset's model, even on the meta device, imports
    torch and its compiler, ~20 s and 300 MB, issue 44). Relative attention (every preset's); another attn_type is
    a ValueError. tests/test_config_presets.py holds it equal to the model's count for every preset and variant."""
    if model.attn_type != "relative":
        raise ValueError(f"parameter_count knows relative attention only, not attn_type={model.attn_type!r}; "
                         "count sum(p.numel() for p in TransformerXL(config).parameters()) instead")
    d, e, hd, V = model.d_model, model.d_embed, model.n_head * model.d_head, model.vocab_size
    bounds = [0, *model.cutoffs, V]
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]  # tokens per cluster (0 = the head's shortlist)
    C = len(model.cutoffs)
    widths = [e] * (C + 1) if model.div_val == 1 else [e // model.div_val ** i for i in range(C + 1)]
    # Adaptive input and softmax (Baevski & Auli 2019; Grave et al. 2017): at div_val 1 one (V, e) table, and
    # (d, e) projections only if e != d (the softmax one per cluster); else a (V_i, e_i) table and a (d, e_i)
    # projection per cluster. The softmax's tables have biases.
    if model.div_val == 1:
        embed_tables, embed_projs = [V * e], [d * e] if e != d else []
        soft_tables, soft_projs = [V * e + V], [d * e] * (C + 1) if e != d else []
    else:
        embed_tables = [n * w for n, w in zip(sizes, widths)]
        embed_projs = [d * w for w in widths]
        soft_tables = [n * w + n for n, w in zip(sizes, widths)]
        soft_projs = [d * w for w in widths]
    # The softmax's tables and projections shared with the input's (tie_weight, tie_projs) are counted once.
    if model.tie_weight:  # the softmax's tables are the embedding's: only their biases are its own
        soft_tables = [t - w for t, w in zip(soft_tables, embed_tables)]
    tied = [i for i, tie in enumerate(model.tie_projs) if tie and soft_projs]
    soft_projs = [p for i, p in enumerate(soft_projs) if i not in tied]
    clusters = C * e + C  # the head's logit per tail cluster: weight and bias
    # A layer: q/k/v and output projections, W_kR (no biases), two layer norms, the feed-forward's two linears;
    # u and v (H, D) each, shared, or per layer with untie_r.
    layer = 3 * hd * d + hd * d + hd * d + 2 * 2 * d + (d * model.d_inner + model.d_inner) + (model.d_inner * d + d)
    u_v = 2 * hd
    layers = model.n_layer * (layer + (u_v if model.untie_r else 0)) + (0 if model.untie_r else u_v)
    compressor = d * d * model.cmem_rate + d if model.cmem_len and model.cmem_fn == "conv" else 0
    return (sum(embed_tables) + sum(embed_projs) + sum(soft_tables) + sum(soft_projs) + clusters + layers
            + compressor)


def load_preset(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """The nested dict of a config: a preset name (configs/<name>.toml), a TOML file, a saved run.json,
    or a run or checkpoint directory (its run.json)."""
    path = Path(name_or_path)
    if not path.suffix and not path.is_dir():
        path = PRESET_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise ValueError(f"unknown preset {str(name_or_path)!r}; presets are: {', '.join(preset_names())} "
                             "(or pass the path of a .toml file or a run's run.json)")
    if path.is_dir():
        path = path / "run.json"
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text(encoding="utf-8"))
        with open(path, "rb") as f:
            return _toml().load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} not found") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except _toml().TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from None


def _toml() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib


def _coerce(section: str, name: str, value: Any, hint: Any) -> Any:
    """Convert ``value`` (a TOML value or a command-line string) to the field's type, or say why not."""
    where = f"{section}.{name}"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(section, name, value, a)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}={value!r} is not allowed; choose one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    raise ValueError(f"{where}={value!r} is not a list; write e.g. 1,2,3 or [1, 2, 3]") from None
            else:
                value = [v for v in text.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{where}={value!r} must be a list")
        return [_coerce(section, name, v, args[0]) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{where}={value!r} must be a boolean (true or false)")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ValueError(f"{where}={value!r} must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{where}={value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where}={value!r} must be a string")
    return value


def field_types(kind: type) -> dict[str, Any]:
    """{field: type hint} of a config dataclass."""
    return typing.get_type_hints(kind)


def typed_section(section: str, kind: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` ({field: text or value}) of a config dataclass ``kind`` outside a run's sections (``txl
    serve``'s ``[serve]``), each converted to its field's type or refused with the one line naming it."""
    hints = field_types(kind)
    for name in values:
        if name not in hints:
            raise ValueError(f"unknown field {section}.{name}{did_you_mean(name, hints)}; valid {section} fields "
                             f"are: {', '.join(sorted(hints))}")
    return {name: _coerce(section, name, value, hints[name]) for name, value in values.items()}


def typed(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of nested ``data`` (a TOML file, a run.json) with every known field's value converted to the
    field's type, or a ValueError naming the field; unknown sections and fields are left for
    ``RunConfig.from_dict`` to name."""
    out: dict[str, Any] = {}
    for section, values in data.items():
        if section not in SECTIONS or not isinstance(values, dict):
            out[section] = values
            continue
        hints = field_types(SECTIONS[section])
        if section == "model":  # a file written before issue 45: its how-fields typed as [compute]'s, moved later
            hints = {**{n: t for n, t in field_types(SECTIONS["compute"]).items() if n in MOVED_FIELDS}, **hints}
        out[section] = {name: _coerce(section, name, value, hints[name]) if name in hints else value
                        for name, value in values.items()}
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """A typed copy of nested ``data`` with 'section.field' -> value overrides (values are strings or typed)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in typed(data).items()}
    for dotted, value in overrides.items():
        section, _, name = dotted.partition(".")
        if section not in SECTIONS or not name:
            raise ValueError(f"unknown option --{dotted}{did_you_mean(section, SECTIONS) if name else ''}; options "
                             "are --SECTION.FIELD with SECTION one of "
                             f"{', '.join(SECTIONS)} (e.g. --model.mem_len 300, --optim.lr 1e-3)")
        hints = field_types(SECTIONS[section])
        if section == "model" and name in MOVED_FIELDS:
            raise ValueError(f"unknown field model.{name}: it is compute.{name} now (--compute.{name}; how the model "
                             "is computed, not what it is)")
        if name not in hints:
            raise ValueError(f"unknown field {section}.{name}{did_you_mean(name, hints)}; valid {section} fields are: "
                             f"{', '.join(sorted(hints))}")
        out.setdefault(section, {})[name] = _coerce(section, name, value, hints[name])
    return out


def run_config(preset: str | os.PathLike = "default", overrides: dict[str, str] | None = None) -> RunConfig:
    """Load a preset, apply overrides, validate."""
    return RunConfig.from_dict(apply_overrides(load_preset(preset), overrides or {}))
