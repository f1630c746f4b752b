"""The command-line surface of the configs: one ``--SECTION.FIELD VALUE`` option per config field.

Every command (``txl train``, ``txl eval``, ..., the experiment drivers and ``benchmarks.run``) registers
the sections it takes with ``add_config_arguments`` and reads the given ones back with ``overrides_from``;
``txl.presets.apply_overrides`` types and validates them, as it does a TOML file's values.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from typing import Any, Literal

from txl.config import SECTIONS
from txl.presets import apply_overrides, field_types, typed_section


def field_docs(kind: type) -> dict[str, str]:
    """Each field's docstring (the string literal under its annotation), read from the class's source:
    the help text and the config reference come from the same place as the code."""
    return _module_field_docs(kind.__module__).get(kind.__qualname__, {})


@functools.cache
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """{class name: {field: docstring}} for every top-level class of ``module``, from one parse of its file
    (``inspect.getsource`` of each class would parse the whole file again, ~50 ms a class)."""
    import ast
    import inspect
    import sys

    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (OSError, TypeError, KeyError):  # no source (a frozen install): no help text, nothing else lost
        return {}
    out = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        docs = out.setdefault(cls.name, {})
        for node, after in zip(cls.body, cls.body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                    isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return out


def _metavar(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return "|".join(_metavar(a) for a in inner) + ("|none" if len(inner) < len(args) else "")
    if origin is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin is list:
        return f"{_metavar(args[0])},..."
    return {int: "INT", float: "FLOAT", str: "STR", bool: "BOOL"}.get(hint, "VALUE")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else str(value)


def add_config_arguments(parser: Any, sections: list[str], *, preset: dict[str, Any] | None = None,
                         preset_name: str = "", kinds: dict[str, type] | None = None) -> None:
    """Register ``--SECTION.FIELD VALUE`` for every field of the given sections, each with its docstring,
    its default and (when ``preset`` is given) the preset's value. Values stay strings here and are typed
    and validated by ``apply_overrides``/``RunConfig``, so a command line and a TOML file give the same
    errors; only the options given appear in the parsed namespace (see ``overrides_from``). ``kinds``: the
    dataclasses of sections that are not a run's (``{"serve": ServeConfig}``), read back with ``section_config``."""
    import argparse

    parser.set_defaults(config_sections=list(sections))
    for section in sections:
        kind = (kinds or {}).get(section) or SECTIONS[section]
        group = parser.add_argument_group(f"{section} ({kind.__doc__.splitlines()[0].rstrip('.')})")
        docs, hints = field_docs(kind), field_types(kind)
        for f in dataclasses.fields(kind):
            if f.default is not dataclasses.MISSING:
                default = _shown(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _shown(f.default_factory())
            else:
                default = "the corpus's" if f.name == "vocab_size" else "required"
            text = docs.get(f.name, "").replace("%", "%%")
            text += f" (default: {default}"
            if preset is not None and f.name in preset.get(section, {}) and \
                    _shown(preset[section][f.name]) != default:
                text += f"; preset {preset_name!r}: {_shown(preset[section][f.name])}"
            bool_flag = hints[f.name] is bool or bool in typing.get_args(hints[f.name])
            group.add_argument(f"--{section}.{f.name}", dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                               metavar=_metavar(hints[f.name]), help=text + ")",
                               **({"nargs": "?", "const": "true"} if bool_flag else {}))


def section_config(args: Any, section: str, kind: type, defaults: dict[str, Any] | None = None) -> Any:
    """The ``kind`` of the ``--SECTION.FIELD`` options given (a section registered with ``kinds=``), typed and
    validated as every config section is; ``defaults`` fill the fields not given."""
    values = {k.split(".", 1)[1]: v for k, v in vars(args).items() if k.startswith(section + ".")}
    return kind(**typed_section(section, kind, {**(defaults or {}), **values}))


def overrides_from(args: Any) -> dict[str, str]:
    """The ``--SECTION.FIELD`` options a parsed namespace holds: {'model.mem_len': '300', ...}."""
    return {k: v for k, v in vars(args).items() if "." in k and k.split(".", 1)[0] in SECTIONS}


def unknown_option_error(extra: list[str], sections: list[str], program: str) -> ValueError:
    """One line for an option argparse did not know: a misspelt config field names the valid ones, a field
    of a section this command does not take says which sections it takes. ``program``: e.g. "txl train"."""
    arg = extra[0]
    key = arg[2:].partition("=")[0] if arg.startswith("--") else ""
    section = key.partition(".")[0]
    if sections and section in SECTIONS and section not in sections:
        return ValueError(f"{program} takes no --{section}.FIELD options; its config options are "
                          f"{', '.join(f'--{s}.FIELD' for s in sections)} (see {program} --help)")
    if section in sections:
        try:
            apply_overrides({}, {key: ""})
        except ValueError as err:
            if "unknown" in str(err):
                return err
    hint = (f"config fields are set as {', '.join(f'--{s}.FIELD' for s in sections)} VALUE" if sections
            else f"{program} takes no config fields")
    return ValueError(f"unrecognised argument {arg!r}; {hint} (see {program} --help)")


def is_main_process() -> bool:
    """Whether this is rank 0 of a torchrun job (or no torchrun job): the one process that prints and
    logs (torch-free, so the entry point can ask before anything heavy is imported)."""
    return os.environ.get("RANK", "0") == "0"
