"""Packaging: one version source, `txl --version`, the license file pyproject names."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import txl
from txl.cli import main

try:
    import tomllib
except ImportError:  # Python 3.10: the cli extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "txl.__version__"}
    assert importlib.metadata.version("txl") == txl.__version__  # the installed metadata agrees


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"txl {txl.__version__}"


def test_license_is_mit():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the txl authors" in text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "MIT"}
